"""The llama.cpp target on the real GGUF: features, batch invariance, rollback, KV state."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.errors import ContextFull, TargetError
from hetero_spec.spec.orchestrator import generate_tokens
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
from tests.invariance import assert_prefix_reuse_equals_fresh_prefill, assert_verify_equals_single_decodes

from .oracle_draft import OracleDraft


@pytest.fixture(scope="module")
def target(model_path):
    with LlamaTarget(model_path, TargetOptions(n_ctx=1024, embeddings=True)) as t:
        yield t


def test_model_facts_come_from_the_gguf(target):
    assert (target.n_vocab, target.n_embd, target.architecture) == (49152, 576, "llama")
    assert "<|im_start|>" in target.chat_template
    ids = target.tokenize("<|im_end|>", add_special=False)
    assert len(ids) == 1 and target.is_eog(ids[0])  # end of turn parsed as one special token
    assert target.detokenize(target.tokenize("Hello world", add_special=False)) == "Hello world"


def test_hidden_state_is_the_lm_head_input(target):
    """Logits == hidden @ head^T: the feature handed to the draft is the final-norm output."""
    from hetero_spec.target.gguf_weights import load_target_weights

    target.reset()
    hidden, logits = target.prefill(target.tokenize("The capital of France is"))
    head = np.asarray(load_target_weights(target.path).head)
    approx = hidden[-1] @ head.T
    # the GGUF head is Q8_0 inside llama.cpp with quantized activations: close, not equal
    assert np.corrcoef(approx, logits)[0, 1] > 0.999
    assert approx.argmax() == logits.argmax()


def test_verify_equals_single_token_decodes_bitwise(target):
    prompt = target.tokenize(bench_prompts("gsm8k", 1)[0])
    extra = target.tokenize(" and then the answer is forty two because", add_special=False)
    assert_verify_equals_single_decodes(target, prompt, extra)


def test_prefix_reuse_equals_fresh_prefill(target):
    assert_prefix_reuse_equals_fresh_prefill(target)


def test_prefill_without_hidden_states_for_early_rows_changes_nothing_else(target):
    """hidden_from: early micro-batches decode with embeddings off; KV, last logits and later rows stay bit-identical."""
    prompt = target.tokenize(" ".join(bench_prompts("alpaca", 4)))[:100]
    extra = target.tokenize(" and the answer is", add_special=False)
    target.reset()
    h_full, l_full = target.prefill(prompt)
    v_full = target.verify(extra)[0].copy()
    target.reset()
    h_lazy, l_lazy = target.prefill(prompt, hidden_from=70)
    assert target.embeddings  # restored
    np.testing.assert_array_equal(l_lazy, l_full)
    np.testing.assert_array_equal(h_lazy[64:], h_full[64:])  # the 32-row batch holding row 70 on
    assert not h_lazy[:64].any()  # the two batches before it: not computed
    np.testing.assert_array_equal(target.verify(extra)[0], v_full)  # same KV cells


def test_prefill_with_taps_reads_every_row_without_the_lm_head(model_path):
    """With a draft's taps the prefill decodes with embeddings off (only the last row pays the LM head) and
    still returns every row's tapped features: bit-identical to decoding the same chunks with every row an
    output, as are the last row's logits and the KV cells a later verify reads."""
    taps = (2, 15, 27)
    with LlamaTarget(model_path, TargetOptions(n_ctx=1024, embeddings=True, taps=taps)) as t:
        prompt = t.tokenize(" ".join(bench_prompts("alpaca", 4)))[:100]
        extra = t.tokenize(" and the answer is", add_special=False)
        switched = []
        set_embeddings = t.set_embeddings
        t.set_embeddings = lambda on: (switched.append(on), set_embeddings(on))[1]
        h_pre, l_pre = t.prefill(prompt)
        del t.set_embeddings
        assert switched[:-1] == [False] * (len(switched) - 1) and switched[-1] and t.embeddings  # off, then restored
        v_pre = t.verify(extra)[0].copy()
        t.reset()
        rows, last = [], None
        for start in range(0, len(prompt), t.options.n_batch):  # the same micro-batches, every row an output
            logits, feats = t.verify(prompt[start:start + t.options.n_batch])
            rows.append(feats.copy())
            last = logits[-1].copy()
        every = np.concatenate(rows)
        assert h_pre.shape == every.shape == (len(prompt), len(taps) * t.n_embd)
        np.testing.assert_array_equal(h_pre, every)
        np.testing.assert_array_equal(l_pre, last)
        np.testing.assert_array_equal(t.verify(extra)[0], v_pre)


def test_kv_after_many_rounds_equals_fresh_decode(target, hs):
    """After speculative rounds with rollbacks, the cache is exactly a fresh decode of the accepted text."""
    p = bench_prompts("mt_bench", 3)[2]
    prompt = target.tokenize(hs.render([{"role": "user", "content": p}]), add_special=False)
    target.reset()
    target.set_embeddings(False)
    plain = [s.tokens for s in generate_tokens(target, None, prompt, max_new_tokens=80, draft_len=0)]
    plain = [t for s in plain for t in s]
    target.reset()
    draft = OracleDraft(prompt + plain, error_rate=0.3, seed=7)
    steps = list(generate_tokens(target, draft, prompt, max_new_tokens=80, draft_len=4))
    assert len([s for s in steps if s.round]) > 15
    kept = list(target.tokens)
    assert kept == (prompt + plain)[: len(kept)] and target.kv_pos_max() == len(kept) - 1
    probe = [plain[len(kept) - len(prompt)]]  # the next token the cache has not seen yet
    cached_logits, _ = target.verify(probe)
    cached = cached_logits[-1].copy()
    target.reset()
    _, fresh = target.prefill(kept + probe)
    np.testing.assert_array_equal(cached, fresh)


def test_context_full_and_empty_prompt(model_path):
    with LlamaTarget(model_path, TargetOptions(n_ctx=32)) as t:
        with pytest.raises(ContextFull):
            t.prefill(list(range(100, 140)))
        with pytest.raises(TargetError):
            t.prefill([])
        steps = list(generate_tokens(t, None, list(range(100, 120)), max_new_tokens=100, draft_len=0))
        assert steps[-1].stop_reason == "context_full" and t.n_past == 32


def test_rollback_drops_cells_by_position(target):
    target.reset()
    target.prefill(target.tokenize("one two three four five six"))
    n = target.n_past
    target.verify([11, 12, 13])
    target.rollback(n + 1)
    assert target.n_past == n + 1 and target.kv_pos_max() == n


@pytest.mark.parametrize("kv_type, threads, exact", [("f16", 1, True), ("f16", 2, False), ("q8_0", 2, True)])
def test_verify_against_single_decodes_past_256_cells(model_path, kv_type, threads, exact):
    """Past 256 KV cells llama.cpp's flash attention splits a one-token decode over F16 cells across
    threads (its split-KV path) but not a multi-row decode: with 2 threads the logits then differ
    (measured up to 0.6).  One thread has one chunk, and quantized cells (q8_0, the default)
    never take that path: verification stays bit-identical to plain decoding at any length."""
    with LlamaTarget(model_path, TargetOptions(n_ctx=1024, n_threads=threads, kv_type=kv_type)) as t:
        prompt = list(range(1000, 1300))  # 300 cells
        extra = list(range(3000, 3005))
        if exact:
            assert_verify_equals_single_decodes(t, prompt, extra)
        else:
            with pytest.raises(AssertionError):
                assert_verify_equals_single_decodes(t, prompt, extra)


def test_ctrl_c_while_llama_cpp_logs_a_load_reaches_the_caller(model_path, monkeypatch):
    """A Ctrl-C that lands in llama.cpp's log callback (a load logs hundreds of lines) was printed by ctypes as
    'Exception ignored' and dropped: the load went on and the run finished. It is raised after the call now."""
    from hetero_spec.target import _ffi

    class Interrupting:  # the callback's log buffer; appending to it is where the signal lands
        class Lines(list):
            def append(self, item):
                raise KeyboardInterrupt

        lines = property(lambda self: Interrupting.Lines(), lambda self, v: None, lambda self: None)

    _ffi.ensure_backend()
    monkeypatch.setattr(_ffi, "_log_capture", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        _ffi.ModelHandle(model_path)
    monkeypatch.undo()
    assert not _ffi._interrupted.is_set()
    model = _ffi.ModelHandle(model_path)  # the next load is unaffected
    assert model.ptr and model.weight_buffers
    model.close()
