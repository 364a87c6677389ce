"""export-features on the real SmolLM2 GGUF with a handful of conversations."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from converters import export_features as ef
from converters.datasets import load_source, sharegpt_path
from converters.export_features import ExportConfig, ExportError, export_features, merge_datasets
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.chat_template import render_chat
from hetero_spec.features import iter_sequences, read_manifest
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

CONVS = [
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "It is 4."},
                       {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "That makes 6."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "Blue."}]},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi there!"}]},
]


THREADS = 1  # on a 2-core machine shared with other jobs, one llama.cpp thread is several times faster


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "chats.jsonl"
    prompts = bench_prompts("alpaca", 4)
    rows = CONVS + [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "ok"}]} for p in prompts]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n" + json.dumps({"conversations": []}) + "\n")
    return path


@pytest.fixture(scope="module")
def target(model_path):
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, n_threads=THREADS)) as t:
        yield t


def cfg(model_path, out, source, **kw) -> ExportConfig:
    return ExportConfig(model=model_path, out=out, source=str(source), max_len=512, dtype="float32",
                        threads=THREADS, **kw)


@pytest.mark.parametrize("topk", [5, 0], ids=["with-head", "head-skipped"])
def test_hidden_states_equal_the_runtime_target(model_path, source, target, tmp_path, topk):
    """At 32-row micro-batches the export is the runtime's arithmetic bit for bit, whether llama.cpp
    runs the LM head (top-k kept) or the eval callback stops the graph before it."""
    m = export_features(cfg(model_path, tmp_path / "f", source, limit=3, topk=topk, prefill_batch=32))
    seqs = list(iter_sequences(tmp_path / "f"))
    assert m.n_sequences == 3 and len(seqs) == 3
    for s in seqs:
        target.reset()
        hidden, last_logits = target.prefill(s.input_ids.tolist())  # the runtime's own prefill
        np.testing.assert_array_equal(s.hidden, hidden)
        if topk:
            top = s.extras["topk_ids"][-1]
            assert top[0] == int(np.argmax(last_logits))
            lp = last_logits - np.log(np.exp(last_logits - last_logits.max()).sum()) - last_logits.max()
            np.testing.assert_allclose(s.extras["topk_logprobs"][-1], lp[top], rtol=1e-3, atol=1e-3)  # float16


def test_large_micro_batches_give_the_runtime_features(model_path, target, tmp_path):
    """The default 512-row micro-batches over q8_0 KV cells (the default) give the runtime's 32-row
    features bit for bit (with F16 cells the flash-attention tiling differed by ~3% RMS)."""
    long_text = " ".join(bench_prompts("mt_bench", 12))
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "Summarise this."},
                                                  {"from": "gpt", "value": long_text}]}) + "\n")
    export_features(cfg(model_path, tmp_path / "f", path))
    (s,) = list(iter_sequences(tmp_path / "f"))
    assert len(s) > 200  # several hundred rows in one micro-batch
    target.reset()
    hidden, _ = target.prefill(s.input_ids.tolist())
    np.testing.assert_array_equal(s.hidden, hidden)


def test_loss_mask_matches_the_template(model_path, source, target, tmp_path):
    export_features(cfg(model_path, tmp_path / "f", source, limit=3))
    eot = target.tokenize("<|im_end|>", add_special=False)
    assert len(eot) == 1 and target.is_eog(eot[0])
    messages = load_source(source).conversations
    for s, conv in zip(iter_sequences(tmp_path / "f"), messages):
        text = render_chat(target.chat_template, conv.messages, bos_token=target.bos_token,
                           eos_token=target.eos_token, add_generation_prompt=False)
        assert s.input_ids.tolist() == target.tokenize(text, add_special=False)  # the template's real output
        # masked runs, read back: each assistant answer followed by its end-of-turn token
        runs, cur = [], []
        for t, m in zip(s.input_ids.tolist(), s.loss_mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        assert [target.detokenize(r[:-1]) for r in runs] == answers
        assert all(r[-1] == eot[0] for r in runs)


def test_regenerate_equals_single_sequence_greedy(model_path, source, tmp_path):
    m = export_features(cfg(model_path, tmp_path / "f", source, limit=5, offset=2, regenerate=True,
                            max_new_tokens=24, n_seq=4))
    seqs = list(iter_sequences(tmp_path / "f"))
    assert len(seqs) == 5
    with LlamaTarget(model_path, TargetOptions(n_ctx=512, n_threads=THREADS, embeddings=False)) as t:
        for s in seqs:
            n_prompt = int(np.argmax(s.loss_mask))
            prompt = s.input_ids[:n_prompt].tolist()
            assert t.detokenize(prompt[-3:]).endswith("assistant\n")
            t.reset()
            _, logits = t.prefill(prompt)
            answer = []
            while len(answer) < 24:
                answer.append(int(np.argmax(logits)))
                if t.is_eog(answer[-1]):
                    break
                logits = t.verify([answer[-1]])[0][-1]
            assert s.input_ids[n_prompt:].tolist() == answer  # batched generation == one sequence alone
            t.set_embeddings(True)
            t.reset()
            hidden, _ = t.prefill(s.input_ids.tolist())
            np.testing.assert_array_equal(s.hidden, hidden)  # hidden states taken during generation
            t.set_embeddings(False)
            assert s.loss_mask[n_prompt:].all() and not s.loss_mask[:n_prompt].any()
    assert m.options["regenerate"] is True


def test_interrupted_export_resumes_to_the_same_dataset(model_path, source, tmp_path, monkeypatch):
    base = cfg(model_path, tmp_path / "whole", source, chunk=2, shard_mb=1)
    export_features(base)
    calls = {"n": 0}
    real = ef._features

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    part = replace(base, out=tmp_path / "part")
    monkeypatch.setattr(ef, "_features", flaky)
    with pytest.raises(KeyboardInterrupt):
        export_features(part)
    monkeypatch.setattr(ef, "_features", real)
    m_mid = read_manifest(part.out)
    assert m_mid.n_sequences == 2 and not m_mid.options["progress"]["done"]  # the finished chunk was kept
    list(iter_sequences(part.out))  # and is readable
    export_features(part)
    a, b = list(iter_sequences(base.out)), list(iter_sequences(part.out))
    assert len(a) == len(b) == 7
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        np.testing.assert_array_equal(x.hidden, y.hidden)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
    assert read_manifest(part.out).skipped == read_manifest(base.out).skipped
    export_features(part)  # complete: a third run does nothing


def test_refuses_other_settings_or_target(model_path, source, tmp_path):
    out = tmp_path / "f"
    export_features(cfg(model_path, out, source, limit=1))
    with pytest.raises(ExportError, match="different settings"):
        export_features(cfg(model_path, out, source, limit=1, topk=3))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["fingerprint"]["tokenizer_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="another target"):
        export_features(cfg(model_path, out, source, limit=1))


def test_shards_partition_the_selection(model_path, source, tmp_path):
    ms = [export_features(cfg(model_path, tmp_path / f"p{i}", source, shard=(i, 2))) for i in range(2)]
    whole = export_features(cfg(model_path, tmp_path / "all", source))
    assert sum(m.n_sequences for m in ms) == whole.n_sequences
    merged = merge_datasets([tmp_path / "p0", tmp_path / "p1"], tmp_path / "merged")
    assert merged.n_sequences == whole.n_sequences and merged.n_tokens == whole.n_tokens
    ids = sorted(tuple(s.input_ids.tolist()) for s in iter_sequences(tmp_path / "merged"))
    assert ids == sorted(tuple(s.input_ids.tolist()) for s in iter_sequences(tmp_path / "all"))
    with pytest.raises(ExportError, match="already holds"):
        merge_datasets([tmp_path / "p0"], tmp_path / "merged")
    export_features(cfg(model_path, tmp_path / "other", source, shard=(0, 2), topk=2))
    with pytest.raises(ExportError, match="settings"):
        merge_datasets([tmp_path / "p1", tmp_path / "other"], tmp_path / "m2")


def test_malformed_input_counted_and_cli_errors_are_one_line(model_path, source, tmp_path):
    cmd = [sys.executable, "-m", "hetero_spec", "export-features"]
    r = subprocess.run(cmd + [str(model_path), str(tmp_path / "ok"), "--source", str(source), "--limit", "2",
                              "--max-len", "256"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = read_manifest(tmp_path / "ok")
    assert m.source["skipped_in_file"] == {"malformed_json": 1, "empty": 1} and m.n_sequences == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
    for args in ([str(bad), str(tmp_path / "x"), "--source", str(source)],
                 [str(model_path), str(tmp_path / "y"), "--source", str(tmp_path / "missing.jsonl")],
                 [str(model_path), str(tmp_path / "z"), "--source", str(source), "--shard", "3/2"]):
        r = subprocess.run(cmd + args, capture_output=True, text=True)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len([x for x in r.stderr.splitlines() if x.strip()]) <= 3  # click usage lines at most


def test_packaged_sharegpt_reader_recovers_the_whole_conversations():
    src = load_source(sharegpt_path())
    assert src.skipped["truncated_tail"] == 1
    whole = len(src.conversations) + src.skipped["empty"]
    assert whole > 17000 and src.skipped.get("malformed_record", 0) == 0


def test_intermediate_layers_via_eval_callback(model_path, source, target, tmp_path):
    from gguf import GGUFReader

    last = 29  # SmolLM2-135M has 30 blocks
    export_features(cfg(model_path, tmp_path / "l", source, limit=2, layers=(3, last), topk=4))
    export_features(cfg(model_path, tmp_path / "p", source, limit=2, topk=4))
    w = next(np.asarray(x.data, dtype=np.float32) for x in GGUFReader(model_path).tensors
             if x.name == "output_norm.weight")
    for s, plain in zip(iter_sequences(tmp_path / "l"), iter_sequences(tmp_path / "p")):
        np.testing.assert_array_equal(s.hidden, plain.hidden)  # observing nodes changes no arithmetic
        np.testing.assert_array_equal(s.extras["topk_ids"], plain.extras["topk_ids"])
        x = s.extras[f"layer_{last}"]
        normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w  # the final RMSNorm by hand
        np.testing.assert_allclose(normed, s.hidden, rtol=1e-4, atol=1e-4)
        assert not np.allclose(s.extras["layer_3"], x)
    with pytest.raises(Exception, match="out of range"):
        export_features(cfg(model_path, tmp_path / "bad", source, limit=1, layers=(30,)))


def test_hf_path_on_a_tiny_random_llama(model_path, source, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")  # the [hf] extra; installed with [dev]
    from tests.tiny_gguf import write_tiny_llama

    gguf = write_tiny_llama(model_path, tmp_path / "tiny.gguf", n_embd=64, n_layer=2, n_head=4, n_ff=128)
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    c = cfg(gguf, tmp_path / "f", source, limit=3, topk=3, layers=(0,))
    m = export_features(c, hf_model=tmp_path / "hf")
    assert m.options["extractor"].startswith("transformers:") and m.fingerprint.n_embd == 64
    export_features(replace(c, out=tmp_path / "g", layers=()))  # the same data through llama.cpp
    for s, g in zip(iter_sequences(tmp_path / "f"), iter_sequences(tmp_path / "g")):
        np.testing.assert_array_equal(s.input_ids, g.input_ids)  # same tokenizer, template and masks
        np.testing.assert_array_equal(s.loss_mask, g.loss_mask)
        with torch.inference_mode():
            out = model(torch.tensor([s.input_ids.tolist()]), output_hidden_states=True)
        np.testing.assert_allclose(s.hidden, out.hidden_states[-1][0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.extras["layer_0"], out.hidden_states[1][0].numpy(), rtol=1e-5, atol=1e-5)
        assert (s.extras["topk_ids"][:, 0] == out.logits[0].argmax(-1).numpy()).all()
    with pytest.raises(Exception, match="does not match the GGUF"):
        export_features(cfg(model_path, tmp_path / "h", source, limit=1), hf_model=tmp_path / "hf")


def test_disk_full_keeps_completed_shards_and_resumes(model_path, source, tmp_path, monkeypatch):
    import errno

    base = cfg(model_path, tmp_path / "whole", source, chunk=2, shard_mb=0)  # a shard after every chunk
    part = replace(base, out=tmp_path / "part")
    real = safetensors.numpy.save_file
    calls = {"n": 0}

    def full_disk(tensors, filename, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            Path(filename).write_bytes(b"partial")  # the disk fills halfway through the third shard
            raise safetensors.SafetensorError(  # what safetensors 0.8 raises then (its I/O errors are not OSError)
                f"Error while serializing: I/O error: No space left on device (os error {errno.ENOSPC}) at path {filename}")
        return real(tensors, filename, *a, **kw)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(ExportError, match=r"\(Error while serializing: I/O error: No space left on device \(os error 28\)\); "
                                          "completed shards are valid"):
        export_features(part)
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    assert calls["n"] == 3
    assert len(read_manifest(part.out).shards) == 2 and not list(part.out.glob(".*tmp*"))
    export_features(part)
    export_features(base)
    a, b = list(iter_sequences(base.out)), list(iter_sequences(part.out))
    assert len(a) == len(b) == 7 and all(np.array_equal(x.hidden, y.hidden) for x, y in zip(a, b))


def test_ctrl_c_inside_the_eval_callback_reaches_the_caller(model_path, monkeypatch):
    """ctypes drops exceptions raised in callbacks; Ctrl-C must still stop the export, not turn into an error."""
    from hetero_spec.target.layer_taps import LayerTapTarget

    with LayerTapTarget(model_path, (), n_ctx=256, n_threads=THREADS, skip_head=True) as t:
        calls = {"n": 0}
        real = t._observe

        def interrupt(tensor, ask):
            if not ask:
                calls["n"] += 1
                raise KeyboardInterrupt
            return real(tensor, ask)

        monkeypatch.setattr(t, "_observe", interrupt)
        with pytest.raises(KeyboardInterrupt):
            t.run(list(range(100, 140)))
        assert calls["n"] == 1  # the graph stopped at the first observed node
        monkeypatch.setattr(t, "_observe", real)
        hidden, _ = t.run(list(range(100, 140)))  # and the context still works
        assert hidden.shape == (40, 576) and np.isfinite(hidden).all()
