"""``BatchGenerator``: many prompts through the batched engine, each answer the one ``HeteroSpec`` gives alone."""
from __future__ import annotations

import pytest

from pathlib import Path

from hetero_spec import BatchGenerator, HeteroSpec, HeteroSpecError

DARTER = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-darter.safetensors"

QUESTIONS = ["Name a colour.", "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
             "What is 2 + 2?", "Say hello in French.", "List three fruits.", "Name a planet."]


@pytest.fixture(scope="module")
def alone(model_path) -> list[str]:
    with HeteroSpec(model_path, n_ctx=512, threads=1) as hs:
        out = []
        for q in QUESTIONS:
            hs.reset()
            out.append(hs.chat([{"role": "user", "content": q}], max_new_tokens=32, draft_len=0).text)
        return out


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "copy-drafts"])
def test_batch_answers_equal_alone(model_path, alone, drafts):
    """Six conversations through three slots (so slots are reused), greedy: every text is the one-by-one text;
    with drafts, a second job on the same layout reads the first one's step prices instead of measuring."""
    with BatchGenerator(model_path, slots=3, n_ctx=512, threads=1, drafts=drafts) as bg:
        prices = dict(bg.engine.cost.ms)  # as calibrated (the steps below keep them current in memory only)
        outs = bg.chat([[{"role": "user", "content": q}] for q in QUESTIONS], max_new_tokens=32, progress=False)
    assert [o.text for o in outs] == alone
    assert all(o.stop_reason in ("eog", "max_tokens") for o in outs)
    if not drafts:
        assert all(o.drafted == 0 for o in outs)
        return
    # the step prices are measured once per machine, model and layout: the next job reads them (a damaged file:
    # tests/unit/test_price_cache.py)
    path = bg.engine.prices_file
    assert path is not None and path.is_file() and len(prices) >= 2
    written = path.stat().st_mtime_ns
    with BatchGenerator(model_path, slots=3, n_ctx=512, threads=1, drafts=drafts) as again:
        assert again.engine.prices_file == path and again.engine.prices_measured_s == 0
        assert again.engine.cost.ms == pytest.approx(prices, abs=1e-4)  # as written (rounded to 0.1 us)
    assert path.stat().st_mtime_ns == written


def test_batch_with_a_draft_model_equals_alone(model_path, alone):
    """The shipped draft drafting in every slot: the same texts, and its rows verified and accepted."""
    with BatchGenerator(model_path, DARTER, slots=3, n_ctx=512, threads=1) as bg:
        assert bg.engine.draft is not None and bg.engine.drafting.draft_depth > 0
        outs = bg.chat([[{"role": "user", "content": q}] for q in QUESTIONS], max_new_tokens=32, progress=False)
    assert [o.text for o in outs] == alone
    assert sum(o.drafted for o in outs) > 0 and sum(o.accepted for o in outs) > 0


def test_batch_bad_input_is_one_error(model_path, tmp_path):
    with pytest.raises(HeteroSpecError, match="no such file"):
        BatchGenerator(tmp_path / "missing.gguf")
    with BatchGenerator(model_path, slots=2, n_ctx=64, threads=1, drafts=False) as bg:
        with pytest.raises(HeteroSpecError, match="prompt 1 has"):
            bg.generate(["hi", "word " * 100], max_new_tokens=4, progress=False)
