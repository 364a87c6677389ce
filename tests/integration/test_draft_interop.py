"""Drafts in and out of the public EAGLE layouts, on real GGUFs.

* Round trip: an EAGLE-3-shaped draft -> export eagle3-hf -> import -> the same config, state dict and
  proposals over the real target's tap features.
* Hand-built EAGLE-1 and EAGLE-3 checkpoints with the official key names, on a tiny GGUF target: the
  imported draft proposes what a from-scratch implementation of the published formulas proposes.
* Refusals, each one line: drafts EAGLE-3 cannot express; heads that do not fit the real target.
* --format gguf (needs scripts/build_llama_cpp.sh's binaries): llama.cpp's converter runs, llama.cpp
  drafts exactly our draft's tokens, and its output equals plain greedy decoding.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.draft.checkpoint import load_draft, save_draft
from hetero_spec.draft.runner import DraftRunner
from hetero_spec.errors import DraftError
from hetero_spec.target.gguf_weights import load_target_weights
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
from tests.integration.test_cli import assert_one_line_error, hetero

TAPS = (2, 15, 27)
H, NH, NKV, FF, THETA, EPS = 64, 4, 2, 96, 10000.0, 1e-5  # the hand-built heads
HD = H // NH


# ----------------------------------------------------------------------------- helpers
def perturb(path: Path, seed: int) -> Path:
    """Weights 5x the init and norms away from 1, so no part of the draft is trivially zero or identity."""
    m = load_draft(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p * 5 if p.dim() > 1 else 1 + 0.3 * torch.randn(p.shape, generator=g))
        if m.cfg.taps:  # a trained draft's input scale: powers of two, per channel
            m.tap_scale.copy_(torch.exp2(torch.randint(-6, 2, m.tap_scale.shape, generator=g).float()))
    save_draft(m, path)
    return path


def runner_for(path: Path, target: Path) -> DraftRunner:
    w = load_target_weights(target)
    m = load_draft(path)
    m.attach_target_weights(torch.from_numpy(np.array(w.embedding)), torch.from_numpy(np.array(w.head)))
    return DraftRunner(m, device="cpu", dtype="float32")


def chains(runner: DraftRunner, feats: np.ndarray, ids: list[int], cuts: tuple[int, ...], k: int = 4) -> list:
    out = []
    for n in cuts:
        runner.reset()
        out.append(runner.propose(feats[:n], ids[1 : n + 1], k=k))
    return out


@pytest.fixture(scope="module")
def eagle3_draft(model_path, tmp_path_factory) -> Path:
    from hetero_spec.draft_factory import create_draft

    out = tmp_path_factory.mktemp("interop") / "e3.safetensors"
    return perturb(create_draft(model_path, out, preset="eagle3", taps=TAPS, reduced_vocab=8192, seed=11), seed=11)


@pytest.fixture(scope="module")
def eagle3_hf(eagle3_draft, model_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interop") / "e3-hf"
    proc = hetero("export-draft", eagle3_draft, "--target", model_path, "--format", "eagle3-hf", out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def tap_rows(model_path) -> tuple[np.ndarray, list[int]]:
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, taps=TAPS, n_threads=1)) as t:
        ids = t.tokenize(" ".join(bench_prompts("mt_bench", 2)))[:64]
        feats, _ = t.prefill(ids)
        return np.array(feats), ids


# ----------------------------------------------------------------------------- round trip
def test_export_import_round_trip_is_identical(eagle3_draft, eagle3_hf, model_path, tap_rows, tmp_path):
    config = json.loads((eagle3_hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 8192
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    back = tmp_path / "back.safetensors"
    proc = hetero("import-draft", "eagle3", eagle3_hf, "--target", model_path, "--out", back)
    assert proc.returncode == 0, proc.stderr
    assert "head: target" in proc.stdout  # the exported lm_head is the target's rows, bit for bit
    a, b = load_draft(eagle3_draft), load_draft(back)
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    # the input scale went into EAGLE-3's fc: W diag(s), exact for powers of two
    assert torch.equal(sb["tap_scale"], torch.ones_like(sa["tap_scale"])) and not torch.equal(sa["tap_scale"], sb["tap_scale"])
    assert torch.equal(sb["tap_fc.weight"], sa["tap_fc.weight"] * sa["tap_scale"][None, :])
    for k in sa.keys() - {"tap_scale", "tap_fc.weight"}:
        assert torch.equal(sa[k], sb[k]), k
    feats, ids = tap_rows
    n = len(ids)
    assert n >= 24
    cuts = (4, n // 3, 2 * n // 3, n - 1)
    ours, theirs = chains(runner_for(eagle3_draft, model_path), feats, ids, cuts), chains(runner_for(back, model_path), feats, ids, cuts)
    assert ours == theirs
    assert len({t for c in ours for t in c}) > 2  # real, varied proposals, not one degenerate token


# ----------------------------------------------------------------------------- export refusals
def test_export_refuses_darter_drafts_in_one_line(random_draft_path, model_path, tmp_path):
    proc = hetero("export-draft", random_draft_path, "--target", model_path, tmp_path / "x")
    assert_one_line_error(proc, "cannot be exported to EAGLE-3", "fusion is 'dgf'", "gate is 'darter'", "no taps")


@pytest.mark.parametrize("preset, taps, expected", [("eagle", (), ("fusion is 'fc'", "no taps")),
                                                    ("eagle3", (2, 15), ("2 taps [2, 15]",))])
def test_export_refuses_what_eagle3_cannot_express(model_path, tmp_path, preset, taps, expected):
    from converters.draft_export import export_draft
    from hetero_spec.draft_factory import create_draft

    draft = create_draft(model_path, tmp_path / "d.safetensors", preset=preset, taps=taps, seed=1)
    with pytest.raises(DraftError) as err:
        export_draft(draft, model_path, tmp_path / "out", "eagle3-hf")
    assert "\n" not in str(err.value) and all(e in str(err.value) for e in expected), str(err.value)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- hand-built public heads
def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, HD], HF's rotate-half RoPE at positions 0..T-1."""
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv
    ang = torch.cat((ang, ang), -1)
    rot = torch.cat((-x[..., HD // 2 :], x[..., : HD // 2]), -1)
    return x * ang.cos().float()[:, None] + rot * ang.sin().float()[:, None]


def attention(x: torch.Tensor, W: dict, p: str) -> torch.Tensor:
    """Causal GQA self-attention of a HF Llama layer ``p`` over rows x [T, in]."""
    T = x.shape[0]
    q = rope((x @ W[p + "self_attn.q_proj.weight"].T).view(T, NH, HD))
    k = rope((x @ W[p + "self_attn.k_proj.weight"].T).view(T, NKV, HD)).repeat_interleave(NH // NKV, 1)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(T, NKV, HD).repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5 + torch.full((T, T), float("-inf")).triu(1)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, H) @ W[p + "self_attn.o_proj.weight"].T


def mlp(x: torch.Tensor, W: dict, p: str) -> torch.Tensor:
    gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T


def llama_layer(W: dict, p: str, in_dim: int) -> None:
    g = torch.Generator().manual_seed(len(W) + in_dim)
    r = lambda *s: torch.randn(*s, generator=g) * 0.15  # noqa: E731
    W |= {p + "self_attn.q_proj.weight": r(NH * HD, in_dim), p + "self_attn.k_proj.weight": r(NKV * HD, in_dim),
          p + "self_attn.v_proj.weight": r(NKV * HD, in_dim), p + "self_attn.o_proj.weight": r(H, NH * HD),
          p + "mlp.gate_proj.weight": r(FF, H), p + "mlp.up_proj.weight": r(FF, H), p + "mlp.down_proj.weight": r(H, FF),
          p + "post_attention_layernorm.weight": 1 + 0.3 * torch.randn(H, generator=g)}


def llama_config(**kw) -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": FF, "num_attention_heads": NH,
            "num_key_value_heads": NKV, "rms_norm_eps": EPS, "rope_theta": THETA, "hidden_act": "silu",
            "max_position_embeddings": 2048, "vocab_size": 49152, **kw}


@pytest.fixture(scope="module")
def tiny_target(model_path, tmp_path_factory) -> Path:
    from tests.tiny_gguf import write_tiny_llama

    return write_tiny_llama(model_path, tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_embd=H, n_layer=8, seed=3)


def eagle1_checkpoint(folder: Path, target_embedding: torch.Tensor, n_layers: int = 2) -> dict:
    """SafeAILab EAGLE-1/2 (model/cnets.py): fc with bias, layer 0 without input_layernorm, no final norm,
    a frozen embed_tokens copy (here the target's plus fp16-like noise); saved as pytorch_model.bin."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(5)
    W = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.15, "fc.bias": torch.randn(H, generator=g) * 0.1}
    for i in range(n_layers):
        llama_layer(W, f"layers.{i}.", H)
        if i > 0:
            W[f"layers.{i}.input_layernorm.weight"] = 1 + 0.3 * torch.randn(H, generator=g)
    W["embed_tokens.weight"] = target_embedding * (1 + 1e-3 * torch.randn(target_embedding.shape, generator=g))
    torch.save(W, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(llama_config(architectures=["LlamaForCausalLM"],
                                                                num_hidden_layers=n_layers)))
    return W


def eagle3_checkpoint(folder: Path, taps: list[int], draft_vocab: int = 512) -> dict:
    """SafeAILab EAGLE-3 / SpecForge: fc over 3 block inputs, midlayer.*, norm, own lm_head over a reduced
    vocabulary with d2t offsets and t2d, an own embed_tokens; taps named under eagle_config (vLLM)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(9)
    W = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.1, "norm.weight": 1 + 0.3 * torch.randn(H, generator=g),
         "midlayer.input_layernorm.weight": 1 + 0.3 * torch.randn(H, generator=g),
         "midlayer.hidden_norm.weight": 1 + 0.3 * torch.randn(H, generator=g),
         "lm_head.weight": torch.randn(draft_vocab, H, generator=g) * 0.3,
         "embed_tokens.weight": torch.randn(49152, H, generator=g)}
    llama_layer(W, "midlayer.", 2 * H)
    kept = torch.randperm(49152, generator=g)[:draft_vocab].sort().values
    W["d2t"] = kept - torch.arange(draft_vocab)
    W["t2d"] = torch.zeros(49152, dtype=torch.bool)
    W["t2d"][kept] = True
    save_file({k: v.contiguous() for k, v in W.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(llama_config(
        architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=draft_vocab,
        target_hidden_size=H, eagle_config={"eagle_aux_hidden_state_layer_ids": taps})))
    return W


def eagle1_reference(W, emb, head, feats, toks, k, n_layers=2) -> list[int]:
    """EAGLE-1's forward recomputed over the whole sequence for every drafted token."""
    feats, toks, out = list(feats), list(toks), []
    for _ in range(k):
        h = torch.cat((emb[torch.tensor(toks)], torch.stack(feats)), -1) @ W["fc.weight"].T + W["fc.bias"]
        for i in range(n_layers):
            p = f"layers.{i}."
            h = h + attention(h if i == 0 else rms(h, W[p + "input_layernorm.weight"]), W, p)
            h = h + mlp(rms(h, W[p + "post_attention_layernorm.weight"]), W, p)
        tok = int((h[-1] @ head.T).argmax())  # no final norm: the target's head reads the layer output
        out.append(tok)
        feats.append(h[-1])
        toks.append(tok)
    return out


def eagle3_reference(W, taps_rows, toks, k) -> list[int]:
    """EAGLE-3's forward: g = fc(taps); [input_layernorm(e); hidden_norm(g)] into the layer, residual g;
    a drafted position's g is the previous step's pre-norm output."""
    g, toks, out, p = list(taps_rows @ W["fc.weight"].T), list(toks), [], "midlayer."
    for _ in range(k):
        G = torch.stack(g)
        x = torch.cat((rms(W["embed_tokens.weight"][torch.tensor(toks)], W[p + "input_layernorm.weight"]),
                       rms(G, W[p + "hidden_norm.weight"])), -1)
        h = G + attention(x, W, p)
        h = h + mlp(rms(h, W[p + "post_attention_layernorm.weight"]), W, p)
        i = int((rms(h[-1], W["norm.weight"]) @ W["lm_head.weight"].T).argmax())
        out.append(i + int(W["d2t"][i]))
        g.append(h[-1])
        toks.append(out[-1])
    return out


def test_hand_built_eagle1_head_imports_exactly(tiny_target, tmp_path):
    from converters.draft_import import import_draft

    w = load_target_weights(tiny_target)
    emb, head = torch.from_numpy(np.array(w.embedding)), torch.from_numpy(np.array(w.head))
    W = eagle1_checkpoint(tmp_path / "eagle1", emb)
    r = import_draft("eagle", tmp_path / "eagle1", tiny_target, tmp_path / "e1.safetensors")
    c = r.config
    assert (c.fusion, c.n_blocks, c.taps, c.final_norm, c.first_attn_norm) == ("fc", 2, (), False, False)
    assert r.embed == "target" and r.embed_diff < 0.01 and r.head == "target"  # the frozen copy is the target's
    g = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(7, H, generator=g), torch.randint(0, 49152, (7,), generator=g).tolist()
    got = runner_for(r.out, tiny_target).propose(feats.numpy(), toks, k=4)
    assert got == eagle1_reference(W, emb, head, feats, toks, k=4)


def test_hand_built_eagle3_head_imports_exactly(tiny_target, tmp_path):
    from converters.draft_import import import_draft

    W = eagle3_checkpoint(tmp_path / "eagle3", taps=[1, 4, 6])
    r = import_draft("eagle3", tmp_path / "eagle3", tiny_target, tmp_path / "e3.safetensors")
    c = r.config
    assert (c.fusion, c.taps, c.reduced_vocab, c.own_head, c.own_embed) == ("eagle3", (1, 4, 6), 512, True, True)
    g = torch.Generator().manual_seed(2)
    rows, toks = torch.randn(9, 3 * H, generator=g) * 3, torch.randint(0, 49152, (9,), generator=g).tolist()
    got = runner_for(r.out, tiny_target).propose(rows.numpy(), toks, k=4)
    assert got == eagle3_reference(W, rows, toks, k=4)
    forced = import_draft("eagle3", tmp_path / "eagle3", tiny_target, tmp_path / "t.safetensors", head="target")
    assert not forced.config.own_head and forced.head == "target"
    # own head and embedding survive a round trip through our export (lm_head, embed_tokens) unchanged
    from converters.draft_export import export_draft

    export_draft(r.out, tiny_target, tmp_path / "again", "eagle3-hf")
    again = import_draft("eagle3", tmp_path / "again", tiny_target, tmp_path / "again.safetensors")
    assert again.config == c and again.head == "own" and again.embed == "own"
    sa, sb = load_draft(r.out).state_dict(), load_draft(again.out).state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- import refusals (real GGUF)
def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_import_refuses_heads_that_do_not_fit_the_target(eagle3_hf, tiny_target, model_path, tmp_path):
    from converters.draft_import import import_draft

    eagle3_checkpoint(tmp_path / "tiny3", taps=[1, 4, 6])
    cases = [
        (tmp_path / "tiny3", "has hidden size 64, the target has 576"),
        (_edited(eagle3_hf, tmp_path / "vocab", vocab_size=32000), "has a vocabulary of 32000, the target has 49152"),
        (_edited(eagle3_hf, tmp_path / "taps", eagle_aux_hidden_state_layer_ids=[2, 15, 30]),
         "taps blocks [30], the target has blocks 0..29"),
        (_edited(eagle3_hf, tmp_path / "wide", target_hidden_size=4096), "reads target features of 4096 values"),
    ]
    for folder, expected in cases:
        with pytest.raises(DraftError) as err:
            import_draft("eagle3", folder, model_path, tmp_path / "x.safetensors")
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(DraftError, match="use import-draft eagle3"):
        import_draft("eagle", eagle3_hf, model_path, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    proc = hetero("import-draft", "eagle3", tmp_path / "taps", "--target", model_path, "--out", tmp_path / "y.safetensors")
    assert_one_line_error(proc, "taps blocks [30]")


# ----------------------------------------------------------------------------- GGUF through llama.cpp
def _speculative_tool() -> Path | None:
    """llama.cpp's llama-speculative-simple, if scripts/build_llama_cpp.sh built it.  (The converter source
    the export needs is fetched by the export itself, as the converter tests do: asked for here at
    collection, before any test had fetched it, it skipped this test whenever the tools had been built
    from an unpacked tree.)"""
    from hetero_spec.bench.llama_server import tools_dir

    tool = tools_dir() / "llama-speculative-simple"
    return tool if tool.is_file() else None


def parse_rounds(log: str) -> list[tuple[list[int], tuple[int, int] | None]]:
    """llama.cpp's debug log -> per round (its greedy drafts, (accepted, the target's next token))."""
    rounds: list = []
    pat = r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)|accepted (\d+)/\d+ draft tokens, the last target token is: \((\d+)\)"
    for m in re.finditer(pat, log):
        if m.group(1) is not None:
            if int(m.group(1)) == 0:
                rounds.append([[], None])
            rounds[-1][0].append(int(m.group(2)))
        else:
            rounds[-1][1] = (int(m.group(3)), int(m.group(4)))
    return rounds


@pytest.mark.skipif(_speculative_tool() is None, reason="llama.cpp's tools are not built: "
                                                        "run `bash scripts/build_llama_cpp.sh` once")
def test_gguf_export_drafts_in_llama_cpp_what_hetero_spec_drafts(eagle3_draft, model_path, tmp_path):
    from converters.draft_export import export_draft
    from hetero_spec.target._ffi import ModelHandle
    from hetero_spec.target.llama_target import kv_type_id
    from hetero_spec.target.kernels import apply_kernel_plan
    from hetero_spec.target.raw_loop import RawGreedy

    gguf = export_draft(eagle3_draft, model_path, tmp_path / "e3.gguf", "gguf")
    tool = _speculative_tool()
    prompt = "The capital of France is"
    cmd = [str(tool), "-m", str(model_path), "-md", str(gguf), "--spec-type", "draft-eagle3", "-p", prompt, "-n", "40",
           "-t", "1", "-td", "1", "--temp", "0", "-c", "512", "-b", "512", "-ub", "32", "-ctk", "q8_0", "-ctv", "q8_0",
           "--spec-draft-n-max", "3", "-s", "1", "-v", *apply_kernel_plan().tool_args()]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rounds = [r for r in parse_rounds(proc.stdout + proc.stderr) if r[1] is not None]
    assert len(rounds) >= 10
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, taps=TAPS, n_threads=1)) as t:
        ids = t.tokenize(prompt)
        seq, ctx_len = list(ids), []
        for drafts, (accepted, last) in rounds:  # the sequence llama.cpp decoded, round by round
            ctx_len.append(len(seq))
            seq += drafts[:accepted] + [last]
        feats, _ = t.prefill(seq)
        feats = np.array(feats)
    model = ModelHandle(Path(model_path))
    raw = RawGreedy(model, n_ctx=512, n_threads=1, kv_type=kv_type_id("q8_0"))
    try:
        plain = raw.generate(ids, len(seq) - len(ids))
    finally:
        raw.close()
    assert seq[len(ids):] == plain  # lossless: llama.cpp's EAGLE-3 decoding equals plain greedy decoding
    runner = runner_for(eagle3_draft, model_path)
    ours = [chains(runner, feats, seq, (n - 1,), k=len(d))[0] for (d, _), n in zip(rounds, ctx_len)]
    assert ours == [d for d, _ in rounds]  # the exported weights (Q/K permutation, norms, d2t) draft as ours do
