"""DGF and gate math, the draft KV cache and its rollback, int8 weights: pure torch, no target."""
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hetero_spec.config import DenoiseConfig, DraftConfig, SamplingConfig
from hetero_spec.draft.int8 import Int8Linear, int8_available
from hetero_spec.draft.model import ConcatFusion, DraftModel, DynamicGatingFusion, _attend_one, init_weights
from hetero_spec.draft.runner import DraftRunner

D, V = 64, 300
CFG = DraftConfig(n_embd=D, n_vocab=V, hidden_size=D, n_heads=4, n_kv_heads=2, ffn_size=128, n_blocks=2,
                  max_positions=256)


def make_model(cfg: DraftConfig = CFG, seed: int = 0) -> DraftModel:
    torch.manual_seed(seed)
    m = init_weights(DraftModel(cfg), seed)
    for p in m.parameters():  # larger weights than the 0.02 init, so that bugs show in outputs
        p.data.mul_(5.0)
    m.attach_target_weights(torch.randn(V, D), torch.randn(V, D))
    return m


def test_dgf_matches_the_dovetail_formula():
    fusion = DynamicGatingFusion(CFG)
    torch.nn.init.normal_(fusion.emb_norm.weight)
    f, e = torch.randn(3, D), torch.randn(3, D)
    h1 = f @ fusion.w1.weight.T
    en = e / torch.sqrt((e * e).mean(-1, keepdim=True) + CFG.rms_eps) * fusion.emb_norm.weight
    h2 = F.silu(en @ fusion.w2.weight.T)
    z = torch.sigmoid(torch.cat([h1, h2], -1) @ fusion.wz.weight.T + fusion.wz.bias)
    torch.testing.assert_close(fusion(f, e)[0], z * h1 + (1 - z) * h2, rtol=1e-5, atol=1e-5)


def test_fc_fusion_is_one_linear_over_embedding_then_feature():
    fusion = ConcatFusion(replace(CFG, fusion="fc"))
    f, e = torch.randn(2, D), torch.randn(2, D)
    expected = e @ fusion.fc.weight[:, :D].T + f @ fusion.fc.weight[:, D:].T + fusion.fc.bias
    torch.testing.assert_close(fusion(f, e)[0], expected, rtol=1e-5, atol=1e-5)


def test_gate_scales_each_key_attention_weight_by_its_importance():
    """softmax(z + log s) = s * exp(z) / sum: the gate multiplies a key's weight by s_j."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    s = torch.tensor([0.9, 0.1, 1.0, 0.5, 0.7])
    out = _attend_one(q, k, v, s.log().view(1, 1, 1, 5))
    qg = q.view(2, 2, 16)
    w = torch.exp(qg @ k[0].transpose(1, 2) / 4.0) * s
    manual = (w / w.sum(-1, keepdim=True)) @ v[0]
    torch.testing.assert_close(out.view(2, 2, 16), manual, rtol=1e-5, atol=1e-5)


def test_masked_key_has_no_influence():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    bias = torch.zeros(1, 1, 1, 5)
    bias[..., 1] = float("-inf")
    out = _attend_one(q, k, v, bias)
    v2 = v.clone()
    v2[:, :, 1] += 100.0
    torch.testing.assert_close(_attend_one(q, k, v2, bias), out)
    assert not torch.allclose(_attend_one(q, k, v2, torch.zeros_like(bias)), out)


def test_gate_starts_open():
    m = DraftModel(CFG)
    assert torch.sigmoid(m.blocks[0].importance.bias).item() > 0.9


def run_rows(runner: DraftRunner, feats: np.ndarray, toks: np.ndarray) -> torch.Tensor:
    f = torch.from_numpy(feats)[None].to(runner.dtype)
    with torch.inference_mode():
        return runner._forward(runner.model.real_input(f), torch.from_numpy(toks)[None])[1].float()


def test_cached_steps_equal_full_forward():
    """Chunked and single-token cached steps reproduce the teacher-forced full pass."""
    m = make_model()
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((12, D)).astype(np.float32)
    toks = rng.integers(0, V, 12)
    with torch.no_grad():
        full, _ = m(torch.from_numpy(feats)[None], torch.from_numpy(toks)[None])
    r = DraftRunner(m, device="cpu", dtype="float32")
    parts = [run_rows(r, feats[:5], toks[:5])] + [run_rows(r, feats[i : i + 1], toks[i : i + 1]) for i in range(5, 8)]
    parts.append(run_rows(r, feats[8:], toks[8:]))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)
    assert r.n == 12


def test_rollback_then_recompute_equals_fresh():
    m = make_model()
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((10, D)).astype(np.float32)
    toks = rng.integers(0, V, 10)
    other = rng.standard_normal((3, D)).astype(np.float32)
    r = DraftRunner(m, device="cpu", dtype="float32")
    run_rows(r, feats, toks)
    r.rollback(7)
    cached = run_rows(r, other, toks[:3])
    fresh_r = DraftRunner(make_model(), device="cpu", dtype="float32")
    run_rows(fresh_r, feats[:7], toks[:7])
    torch.testing.assert_close(cached, run_rows(fresh_r, other, toks[:3]))
    with pytest.raises(Exception):
        r.rollback(r.n + 1)


def test_propose_returns_k_target_ids_and_keeps_speculative_cells():
    cfg = replace(CFG, reduced_vocab=50)
    m = make_model(cfg)
    m.d2t = torch.arange(250, 300)  # head row i is target id 250 + i
    m.attach_target_weights(m.embed, torch.randn(V, D))
    r = DraftRunner(m, device="cpu", dtype="float32")
    rng = np.random.default_rng(2)
    out = r.propose(rng.standard_normal((4, D)).astype(np.float32), [1, 2, 3, 4], k=3)
    assert len(out) == 3 and all(250 <= t < 300 for t in out)
    assert r.n == 4 + 2  # four real cells, two cells from drafted tokens


def test_denoising_mask_drops_unimportant_old_keys_only():
    m = make_model()
    r = DraftRunner(m, device="cpu", dtype="float32", denoise=DenoiseConfig(threshold=0.5, recent_window=3))
    log_gate = torch.log(torch.tensor([0.9, 0.1, 0.2, 0.8, 0.1, 0.05, 0.3]))
    bias = r._bias(log_gate, T=1, L=7, gated=True).view(-1)
    assert torch.isinf(bias[1]) and torch.isinf(bias[2])  # old and below threshold: dropped
    assert torch.isfinite(bias[0]) and torch.isfinite(bias[3])  # old but important: kept with log s
    assert torch.isfinite(bias[4:]).all()  # recent window kept whatever its gate (current token included)
    torch.testing.assert_close(bias[4:], log_gate[4:])
    off = DraftRunner(make_model(), device="cpu", dtype="float32")
    assert torch.isfinite(off._bias(log_gate, T=1, L=7, gated=True)).all()


SATURATION_CHECK = """
import json, torch
from hetero_spec.draft.int8 import Int8Linear
torch.manual_seed(0)
lin = torch.nn.Linear(256, 512)  # uniform weights: many near the int8 maximum
x = torch.randn(16, 256) + 0.5
ref = lin(x)
err = lambda rr: float((torch.cat([Int8Linear(lin.weight, lin.bias, rr)(r) for r in x.split(1)]) - ref).norm() / ref.norm())
print(json.dumps({"full": err(False), "reduced": err(True)}))
"""


def _linear_errors(env: dict | None = None) -> dict:
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SATURATION_CHECK], env={**os.environ, **(env or {})},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_int8_reduced_range_is_close_to_float_on_any_kernel():
    """7-bit activations cannot saturate fbgemm's int16 pair sums: close to float on this CPU's kernels
    and on the AVX2 (non-VNNI) ones forced with FBGEMM_ENABLE_INSTRUCTIONS."""
    for env in (None, {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}):
        assert _linear_errors(env)["reduced"] < 0.03


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_int8_full_range_saturates_on_non_vnni_kernels():
    """The failure the reduced mode exists for: 8-bit activations on the AVX2 kernels (what a CPU without
    VNNI runs) come out several times further from float than 7-bit ones."""
    avx2 = _linear_errors({"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"})
    assert avx2["full"] > 2 * avx2["reduced"]
    assert avx2["full"] > 0.05


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
@pytest.mark.parametrize("mode", ["int8-full", "int8-reduced"])
def test_int8_runner_proposes_like_float_runner_mostly(mode):
    m = make_model()
    rng = np.random.default_rng(3)
    feats = rng.standard_normal((20, D)).astype(np.float32)
    toks = rng.integers(0, V, 20)
    a = DraftRunner(make_model(), device="cpu", dtype="float32")
    b = DraftRunner(m, device="cpu", dtype=mode, calibration=(feats, toks))
    assert b.weights == mode.replace("-full", "")
    fa, fb = run_rows(a, feats, toks), run_rows(b, feats, toks)
    limit = 0.1 if mode == "int8-reduced" or _linear_errors()["full"] < 0.03 else float("inf")
    assert ((fa - fb).norm() / fa.norm()) < limit


def test_auto_dtype_falls_back_to_float_when_int8_disagrees():
    """Where int8 proposals disagree with float's (here a head whose rows differ by 1e-5, so the argmax
    hangs on differences far below int8's precision), auto must not run int8, and must say what it measured."""
    m = make_model()
    near_tied = torch.randn(1, D).expand(V, D) + 1e-5 * torch.randn(V, D)
    m.attach_target_weights(m.embed, near_tied.contiguous())
    r = DraftRunner(m, device="cpu", dtype="auto")
    check = r.int8_check
    assert check is not None and check.mode is None
    assert r.weights in ("float32", "bfloat16")


def test_skipped_positions_take_no_attention():
    """Cells skipped for want of features are masked: with RoPE only relative positions count, so rows
    placed after a hole of 5 behave like the same rows from position 0; garbage in those cells would not."""
    m = make_model()
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((7, D)).astype(np.float32)
    toks = rng.integers(0, V, 7)
    holed = DraftRunner(m, device="cpu", dtype="float32")
    holed.skip(5)
    assert holed.n == 5
    out = run_rows(holed, feats, toks)
    fresh = run_rows(DraftRunner(make_model(), device="cpu", dtype="float32"), feats, toks)
    torch.testing.assert_close(out, fresh, rtol=1e-4, atol=1e-4)
    filled = DraftRunner(make_model(), device="cpu", dtype="float32")
    run_rows(filled, rng.standard_normal((5, D)).astype(np.float32), rng.integers(0, V, 5))
    assert not torch.allclose(run_rows(filled, feats, toks), fresh, atol=1e-3)
    holed.rollback(2)  # cells rewritten after a rollback are real again
    run_rows(holed, feats[:3], toks[:3])
    ref = DraftRunner(make_model(), device="cpu", dtype="float32")
    ref.skip(2)
    run_rows(ref, feats[:3], toks[:3])
    torch.testing.assert_close(run_rows(holed, feats[3:], toks[3:]), run_rows(ref, feats[3:], toks[3:]))
    with pytest.raises(Exception):
        holed.skip(10_000)


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_rescored_int8_head_picks_the_float_argmax():
    """The int8 head's top rows are recomputed in float, so its argmax is the float head's wherever the
    true best row is among the int8 top 8; a plain int8 head flips the near-ties planted here."""
    from hetero_spec.draft.int8 import RescoredInt8Head

    torch.manual_seed(1)
    base = torch.randn(512, 64)
    head = torch.cat([base, base[:64] + 1e-3 * torch.randn(64, 64)])  # 64 near-twins of rows 0..63
    feats = torch.randn(400, 64)
    exact = feats @ head.t()
    rescored = RescoredInt8Head(head, reduce_range=True, smooth=None)
    plain = Int8Linear(head, None, True)
    got = torch.cat([rescored(f) for f in feats.split(1)])
    flat = torch.cat([plain(f) for f in feats.split(1)])
    assert bool((got.argmax(-1) == exact.argmax(-1)).all())
    assert int((flat.argmax(-1) != exact.argmax(-1)).sum()) > 0  # the planted ties do flip without rescoring
    top = exact.topk(2, dim=-1).indices  # the best two (here often a planted pair) carry float's values
    torch.testing.assert_close(got.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    best = [rescored.best(f) for f in feats.split(1)]  # the greedy path: the argmax without the full logits
    assert [int(row) for row, _ in best] == exact.argmax(-1).tolist()
    torch.testing.assert_close(torch.stack([score for _, score in best]), exact.max(-1).values, rtol=1e-5, atol=1e-5)


def _gated_model(cfg: DraftConfig = CFG) -> DraftModel:
    """make_model with gates that differ per key, so a wrong bias or a wrong cell shows in the outputs."""
    m = make_model(cfg)
    for blk in m.blocks:
        torch.nn.init.normal_(blk.importance.weight, std=0.3)
        torch.nn.init.constant_(blk.importance.bias, 0.0)
    return m


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, fusion="eagle3", n_blocks=1), replace(CFG, gate="none", fusion="fc")],
                         ids=["dgf-gated", "eagle3", "fc-ungated"])
@pytest.mark.parametrize("denoise", [DenoiseConfig(), DenoiseConfig(threshold=0.5, recent_window=3)], ids=["plain", "denoised"])
def test_one_row_forward_equals_the_general_forward(cfg, denoise):
    """The one-position path (``_forward_one``) is the general ``_blocks`` arithmetic in fewer calls: the same
    features after holes, rollbacks and drafted steps, and the same proposals."""
    make = (lambda: _gated_model(cfg)) if cfg.gate == "darter" else (lambda: make_model(cfg))
    rng = np.random.default_rng(5)
    feats = rng.standard_normal((14, D)).astype(np.float32)
    toks = rng.integers(0, V, 14)
    runners = [DraftRunner(make(), device="cpu", dtype="float32", denoise=denoise) for _ in range(2)]
    runners[1]._one_row = False
    outs = []
    for r in runners:
        r.skip(2)
        run_rows(r, feats[:6], toks[:6])
        steps = [run_rows(r, feats[i : i + 1], toks[i : i + 1]) for i in range(6, 10)]
        r.rollback(8)
        steps += [run_rows(r, feats[i : i + 1], toks[i : i + 1]) for i in range(10, 14)]
        outs.append((torch.cat(steps, dim=1), r.propose(feats[:1], toks[:1], k=4), r.n))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1:] == outs[1][1:]


@pytest.mark.parametrize("denoise", [DenoiseConfig(), DenoiseConfig(threshold=0.5, recent_window=3)], ids=["plain", "denoised"])
def test_static_step_equals_the_one_row_forward(denoise):
    """The static-shape step (what CUDA captures as a graph) run eagerly on the CPU: the same features and
    cache cells as ``_forward_one`` over the whole fixed-size cache, whatever stale cells lie after the
    position (here a longer earlier chain) and whatever holes lie before it."""
    from hetero_spec.draft.static_step import StaticStep

    rng = np.random.default_rng(6)
    feats = rng.standard_normal((12, D)).astype(np.float32)
    toks = rng.integers(0, V, 12)
    dyn, sta = (DraftRunner(_gated_model(), device="cpu", dtype="float32", denoise=denoise) for _ in range(2))
    step = StaticStep(sta, graph=False)
    for r in (dyn, sta):
        r.skip(3)
        run_rows(r, feats[:8], toks[:8])  # 11 cells; 8..10 are rolled back next and become stale
        r.rollback(8)
    with torch.inference_mode():
        for i in range(8, 12):
            g = dyn.model.real_input(torch.from_numpy(feats[i : i + 1])[None])
            tok = torch.from_numpy(toks[i : i + 1])[None]
            want = dyn._forward_one(g, tok)
            got = step(g, tok)
            for a, b in zip(want, got):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sta.n == dyn.n == 12
    torch.testing.assert_close(sta.cache.k[0][:, :, :12], dyn.cache.k[0][:, :, :12])
    torch.testing.assert_close(sta.cache.log_gate[1][:12], dyn.cache.log_gate[1][:12])


def test_proposals_are_read_back_once_per_chain():
    """A chain of k proposals leaves the device once (one ``tolist`` of the stacked ids): on a GPU that is
    the round's one synchronisation.  Counted through torch.Tensor.tolist / item / __int__ on the CPU."""
    r = DraftRunner(make_model(), device="cpu", dtype="float32")
    rng = np.random.default_rng(7)
    calls = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__int__")}
    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=fn: calls.append(_n) or _f(self, *a))
        out = r.propose(rng.standard_normal((1, D)).astype(np.float32), [3], k=4)
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    assert len(out) == 4 and calls == ["tolist"]


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="torch without weight-only int8")
def test_weight_only_int8_keeps_outlier_activations():
    """Weight-only int8 (the fusion's layers) stays within 1% of float on rows with a few channels 50x the
    rest, where fbgemm's dynamic int8 (activations quantized per row) loses the small channels."""
    from hetero_spec.draft.int8 import WeightInt8Linear

    torch.manual_seed(2)
    lin = torch.nn.Linear(256, 128)
    x = torch.randn(32, 256)
    x[:, :3] *= 50.0  # the target features' outlier channels
    ref = lin(x).detach()
    rel = lambda y: float((y - ref).norm() / ref.norm())  # noqa: E731
    weight_only = rel(WeightInt8Linear(lin.weight, lin.bias)(x))
    assert weight_only < 0.01
    if int8_available():
        dynamic = rel(torch.cat([Int8Linear(lin.weight, lin.bias)(r) for r in x.split(1)]))
        assert dynamic > 2 * weight_only


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_int8_runner_quantizes_every_layer():
    """int8 leaves no float32 matmul weight in the draft: fbgemm int8 blocks and head, weight-only int8 fusion and taps' fc."""
    from hetero_spec.draft.int8 import Int8Linear as Dyn, WeightInt8Linear, weight_int8_available

    cfg = replace(CFG, taps=(1, 2))
    rng = np.random.default_rng(8)
    feats = rng.standard_normal((20, 2 * D)).astype(np.float32)
    r = DraftRunner(make_model(cfg), device="cpu", dtype="int8-full", calibration=(feats, rng.integers(0, V, 20)))
    linears = [n for n, mod in r.model.named_modules() if isinstance(mod, torch.nn.Linear) and mod.out_features > 1]
    assert linears == ([] if weight_int8_available() else ["tap_fc", "fusion.w1", "fusion.w2", "fusion.wz"])
    assert isinstance(r.model.blocks[0].qkv, Dyn)
    if weight_int8_available():
        assert isinstance(r.model.tap_fc, WeightInt8Linear) and isinstance(r.model.fusion.wz, WeightInt8Linear)
    assert len(r.propose(feats[:2], [1, 2], k=3)) == 3


@pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
def test_int8_check_leaves_the_runner_on_its_threads():
    """The int8 check builds runners of its own; the draft must still run on the threads it was given (the
    target's), not on whatever the check's runners set."""
    before = torch.get_num_threads()
    try:
        DraftRunner(make_model(), device="cpu", dtype="auto", cpu_threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_greedy_tree_keeps_its_best_nodes_of_all_depths():
    """EAGLE-2's reranking: with 2 tokens and top_k 2 a greedy tree is the chain c1 -> g or the siblings c1, c2,
    whichever the draft rates likelier (p(c1) p(g | c1) against p(c2)), and only c1 is forwarded to find g, since
    c2's children could never be kept.  A sampled tree fills its budget level by level and prunes nothing."""
    m = make_model()
    with torch.no_grad():
        m.head.mul_(0.1)  # flatter distributions, so that both shapes win somewhere
    r = DraftRunner(m, device="cpu", dtype="float32")
    seen, probs = set(), []
    frontier_probs = r._frontier_probs
    r._frontier_probs = lambda feats, sampling, greedy: probs.append(frontier_probs(feats, sampling, greedy)) or probs[-1]
    rng = np.random.default_rng(5)
    feats, toks = rng.standard_normal((60, D)).astype(np.float32) * 3, rng.integers(0, V, 60)
    r.prefill(feats[:4], toks[:4])
    for i in range(4, 60):
        probs.clear()
        prop = r.propose_tree(feats[i : i + 1], toks[i : i + 1], top_k=2, total_tokens=2, depth=2)
        root, level2 = probs[0][0], probs[1]
        assert level2.shape[0] == 1  # only the best child was forwarded
        p1, p2 = np.sort(root)[::-1][:2]
        chain = p1 * level2[0].max() > p2
        assert prop.parents.tolist() == ([-1, 0, 1] if chain else [-1, 0, 0])
        assert prop.tokens[1] == int(np.argmax(root)) and prop.depth_forwards == prop.forwarded_rows == 1
        if chain:
            assert prop.tokens[2] == int(np.argmax(level2[0]))
        seen.add(chain)
        r.rollback(prop.n_real)
    assert seen == {True, False}  # both shapes were chosen
    sampled = r.propose_tree(feats[:1], toks[:1], top_k=2, total_tokens=2, depth=2,
                             sampling=SamplingConfig(temperature=1.0), rng=np.random.default_rng(0))
    assert sampled.parents.tolist() == [-1, 0, 0] and sampled.depth_forwards == 0
