"""The first-use batch-invariance check: it finds where a file's verification rows stop being bit-exact, it is
cached, the runtime never verifies more rows than it found, and ``--exact`` makes a file that holds to 32 rows.

Tiny random-weight models of the llama family (``hetero_spec.tiny_models``, built once and cached) stand for
users' files; the default all-Q4_0 SmolLM2 target for the invariant case.  Bounds per type and kernel path
are docs/exactness.md's: a repacked Q4_K_M file changes from 4 rows, a plain one from 8 (its Q6_K tensors),
float files from 2, all-Q4_0 not up to 32.
"""
from __future__ import annotations

import warnings

import pytest
from click.testing import CliRunner

from hetero_spec.api import AUTO_MAX_CHAIN, ExactnessWarning, HeteroSpec
from hetero_spec.cli import cli
from hetero_spec.config import TreeSpec
from hetero_spec.target import invariance
from hetero_spec.target.llama_target import BATCH_INVARIANT_ROWS, LlamaTarget, TargetOptions
from hetero_spec.tiny_models import tiny_model_path
from tests.curves import CHEAP_ROWS  # verification rows nearly free: auto drafts the longest chains its cap allows

PROMPT = "the farmer sold sixteen eggs and the farmer sold sixteen eggs and the farmer sold"


def repacked(t: LlamaTarget) -> bool:
    return bool(set(t._model.weight_buffers) & {"CPU_REPACK", "AMX"})


@pytest.fixture(scope="module")
def q4_k_m():
    return tiny_model_path("llama", "Q4_K_M")


@pytest.fixture(scope="module")
def f32():
    path = tiny_model_path("llama", "Q8_0").with_name("llama-F32.gguf")  # the quantizations' source, kept
    assert path.is_file()
    return path


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    from hetero_spec.draft_factory import create_draft

    out = tmp_path_factory.mktemp("inv-draft") / "llama.safetensors"
    return create_draft(tiny_model_path("llama", "Q8_0"), out, preset="darter", reduced_vocab=256, seed=1)


def test_check_finds_the_documented_bound_where_rows_break(q4_k_m, f32):
    """Q4_K_M: 3 rows repacked, 7 plain; float weights: 1.  And the bound is real: the first row count past
    it differs from one-row decodes, every count up to it does not (checked on other tokens than the check's)."""
    with LlamaTarget(q4_k_m, TargetOptions(n_ctx=256, n_threads=1)) as t:
        got = invariance.measure(t, BATCH_INVARIANT_ROWS)
        assert got.exact_rows == (3 if repacked(t) else 7), got
        assert got.first_failing == got.exact_rows + 1 and got.checked_rows == BATCH_INVARIANT_ROWS
    with LlamaTarget(f32, TargetOptions(n_ctx=256, n_threads=1)) as t:
        assert invariance.measure(t, BATCH_INVARIANT_ROWS).exact_rows == 1


def test_default_all_q4_0_model_is_exact_to_the_widest_verification(model_path):
    from hetero_spec.default_model import default_model_path

    with LlamaTarget(default_model_path(), TargetOptions(n_ctx=256)) as t:
        got = invariance.check(t)
    assert got.exact_rows == got.checked_rows == BATCH_INVARIANT_ROWS > AUTO_MAX_CHAIN + 1
    assert got.first_failing is None


def test_check_is_cached_per_file_and_machine(q4_k_m, monkeypatch):
    with LlamaTarget(q4_k_m, TargetOptions(n_ctx=256, n_threads=1)) as t:
        invariance.cache_file(t).unlink(missing_ok=True)
        first = invariance.check(t)
        assert not first.cached and invariance.cache_file(t).is_file()
    decodes = []
    monkeypatch.setattr(LlamaTarget, "verify", lambda self, tokens: decodes.append(len(tokens)))
    monkeypatch.setattr(LlamaTarget, "prefill", lambda self, tokens, **kw: decodes.append(len(tokens)))
    with LlamaTarget(q4_k_m, TargetOptions(n_ctx=256, n_threads=1)) as t:
        second = invariance.check(t)
        assert second.cached and second.exact_rows == first.exact_rows and decodes == []
        other_threads = invariance.cache_file(t)
    with LlamaTarget(q4_k_m, TargetOptions(n_ctx=256, n_threads=2)) as t:
        assert invariance.cache_file(t) != other_threads  # thread count is part of the key


def _rows_seen(hs: HeteroSpec) -> list[int]:
    """Rows of every verification the target decodes from now on (one-row decodes included)."""
    seen: list[int] = []
    verify, verify_tree = hs.target.verify, hs.target.verify_tree
    hs.target.verify = lambda tokens: (seen.append(len(tokens)), verify(tokens))[1]
    hs.target.verify_tree = lambda tokens, *a: (seen.append(len(tokens)), verify_tree(tokens, *a))[1]
    return seen


def test_runtime_never_verifies_more_rows_than_exact(q4_k_m, draft):
    """Fixed k, a fixed tree, auto chains and copy sources all stay within ``exact_rows`` (fixed settings with
    one warning each), and output stays plain decoding's; trusting a wider bound does verify wider."""
    modes = {"k7": dict(draft_len=7), "tree": dict(draft_len=6, tree=TreeSpec(12, 6, 2)), "auto": dict(draft_len="auto")}
    with HeteroSpec(q4_k_m, draft, n_ctx=512, threads=1, draft_device="cpu", draft_dtype="float32") as hs:
        assert hs.exact_rows == hs.invariance.exact_rows < 8
        hs._curve = CHEAP_ROWS
        plain = hs.generate(PROMPT, max_new_tokens=40, draft_len=0).tokens
        seen = _rows_seen(hs)
        for name, kw in modes.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = hs.generate(PROMPT, max_new_tokens=40, **kw)
            assert out.tokens == plain, name
            assert 1 < max(seen) <= hs.exact_rows, (name, max(seen))
            if name != "auto":  # a fixed setting reaches the cap (auto's depth follows its estimates)
                assert max(seen) == hs.exact_rows, (name, max(seen))
            assert max(r.drafted for r in out.stats.rounds) <= hs.max_drafts
            clamped = [w for w in caught if issubclass(w.category, ExactnessWarning)]
            assert len(clamped) == (name != "auto"), [str(w.message) for w in caught]
            seen.clear()
    with HeteroSpec(q4_k_m, draft, n_ctx=512, threads=1, draft_device="cpu", draft_dtype="float32",
                    exact_rows=BATCH_INVARIANT_ROWS) as hs:
        assert hs.invariance is None
        seen = _rows_seen(hs)
        hs.generate(PROMPT, max_new_tokens=16, draft_len=7)
        assert max(seen) == 8


def test_copy_sources_and_float_files(f32, draft):
    """Without a draft, auto's prompt lookup and suffix trees stay within the cap too; where no two rows are
    exact (float weights) every round is plain, and the load says so in one warning."""
    with pytest.warns(ExactnessWarning, match="plain decoding only") as caught:
        hs = HeteroSpec(f32, draft, n_ctx=512, threads=1, draft_device="cpu", draft_dtype="float32")
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with hs:
        assert hs.exact_rows == 1
        seen = _rows_seen(hs)
        with pytest.warns(ExactnessWarning, match="plain decoding"):
            out = hs.generate(PROMPT, max_new_tokens=24, draft_len=3)
        assert set(seen) <= {1} and all(r.drafted == 0 for r in out.stats.rounds)


def test_suffix_trees_respect_the_cap(q4_k_m):
    with HeteroSpec(q4_k_m, None, n_ctx=512, threads=1) as hs:
        hs._curve = CHEAP_ROWS
        plain = hs.generate(PROMPT, max_new_tokens=40, draft_len=0).tokens
        nodes = hs.suffix_cache.config.max_nodes
        seen = _rows_seen(hs)
        for _ in range(2):  # the second call also drafts from the first one's output
            out = hs.generate(PROMPT, max_new_tokens=40, draft_len="auto", suffix=True)
            assert out.tokens == plain
        assert 1 < max(seen) <= hs.exact_rows
        assert hs.suffix_cache.config.max_nodes == nodes  # the cap held for the requests only


def test_exact_requantizes_once_to_an_invariant_file(q4_k_m):
    plan = invariance.nearest_exact(q4_k_m)
    assert (plan.type, plan.output_tensor_type) == ("Q5_0", "Q8_0")  # Q4_K matrices, a Q6_K head
    with HeteroSpec(q4_k_m, None, n_ctx=256, threads=1, exact=True) as hs:
        made = hs.target.path
        assert made != q4_k_m and made.is_file()
        assert hs.exact_rows == hs.invariance.exact_rows == BATCH_INVARIANT_ROWS
        assert set(invariance.tensor_types(made).values()) <= {"Q5_0", "Q8_0", "F32"}
        text = hs.generate(PROMPT, max_new_tokens=8, draft_len=0).text
    mtime = made.stat().st_mtime_ns
    assert invariance.exact_requantization(q4_k_m) == made and made.stat().st_mtime_ns == mtime  # made once
    r = CliRunner().invoke(cli, ["run", str(q4_k_m), "--no-draft", "--raw", "-p", PROMPT, "-n", "8", "--exact",
                                 "-t", "1", "-v"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"capped at {BATCH_INVARIANT_ROWS} rows" in r.output and text in r.output


def test_run_says_so_in_one_line_where_few_rows_are_exact(f32):
    r = CliRunner().invoke(cli, ["run", str(f32), "--no-draft", "--raw", "-p", PROMPT, "-n", "4", "-t", "1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    notices = [line for line in r.output.splitlines() if line.startswith("warning:")]
    assert len(notices) == 1 and "--exact" in notices[0], r.output
