"""Mistakes an app makes with the Python API: each is one clear ``HeteroSpecError`` and leaves the object usable,
where it was a segfault, an abort, wrong text, or an object that refused every later call."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hetero_spec import BatchGenerator, ConfigError, HeteroSpec, HeteroSpecError, TreeSpec
from hetero_spec.config import MAX_THREADS
from hetero_spec.target import _ffi
from hetero_spec.target.llama_target import LlamaTarget

DARTER = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-darter.safetensors"

PROMPT = "Once upon a time"
OTHER = "The capital of France is"
LONG = "Write a story about a lighthouse keeper and the storm. " * 12


@pytest.fixture(scope="module")
def hs(model_path):
    with HeteroSpec(model_path, n_ctx=512, threads=1) as h:
        yield h


@pytest.fixture(scope="module")
def plain(hs) -> dict[str, str]:
    """Each prompt's greedy text from a fresh conversation."""
    out = {}
    for p in (PROMPT, OTHER, LONG):
        hs.reset()
        out[p] = hs.generate(p, max_new_tokens=12, draft_len=0).text
    return out


def test_use_after_close_is_an_error_not_a_segfault(model_path):
    with HeteroSpec(model_path, n_ctx=256, threads=1) as h:
        stream = h.generate(PROMPT, max_new_tokens=8, stream=True)
    with pytest.raises(HeteroSpecError, match="closed"):
        list(stream)  # a lazy stream read after its with block
    for call in (lambda: h.generate(PROMPT, max_new_tokens=4), h.reset, lambda: h.render([{"role": "user",
                                                                                          "content": "x"}])):
        with pytest.raises(HeteroSpecError, match="closed"):
            call()
    h.close()  # twice is fine
    with BatchGenerator(model_path, slots=2, n_ctx=128, threads=1, drafts=False) as bg:
        pass
    with pytest.raises(HeteroSpecError, match="closed"):
        bg.generate([PROMPT], max_new_tokens=4, progress=False)


def test_a_second_thread_is_refused_while_a_call_runs(hs, plain):
    """Two threads in one llama_decode aborted the process; now the second call is refused at once and the
    first one's text is untouched."""
    inside, tried = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def first_round_waits() -> bool:  # the running call's cancel hook: hold it inside until the other tried
        inside.set()
        tried.wait(30)
        return False

    def other_thread() -> None:
        inside.wait(30)
        try:
            hs.generate(OTHER, max_new_tokens=4)
        except HeteroSpecError as exc:
            refused.append(exc)
        finally:
            tried.set()

    t = threading.Thread(target=other_thread)
    t.start()
    hs.reset()
    text = hs.generate(PROMPT, max_new_tokens=12, draft_len=0, cancel=first_round_waits).text
    t.join(30)
    assert len(refused) == 1 and "another thread" in str(refused[0])
    assert text == plain[PROMPT]


def test_a_call_from_inside_a_call_is_named(hs):
    """A cancel hook that calls the same HeteroSpec: not 'another thread', and close() there would deadlock."""
    seen: list[str] = []

    def hook() -> bool:
        for call in (hs.reset, hs.close):
            try:
                call()
            except HeteroSpecError as exc:
                seen.append(str(exc))
        return True

    hs.generate(PROMPT, max_new_tokens=4, draft_len=0, cancel=hook)
    assert len(seen) == 2 and all("inside" in msg for msg in seen), seen


def test_a_later_call_closes_an_open_stream_instead_of_mixing_them(hs, plain):
    hs.reset()
    first = hs.generate(PROMPT, max_new_tokens=12, draft_len=0, stream=True)
    pieces = iter(first)
    text = next(pieces)
    hs.render([{"role": "user", "content": "x"}])  # reads the template only: the stream goes on
    text += "".join(pieces)
    assert text == plain[PROMPT]
    hs.reset()
    first = hs.generate(PROMPT, max_new_tokens=12, draft_len=0, stream=True)
    pieces = iter(first)
    next(pieces)
    hs.reset()
    assert hs.generate(OTHER, max_new_tokens=12, draft_len=0).text == plain[OTHER]
    with pytest.raises(HeteroSpecError, match="closed by a later call"):
        next(pieces)
    assert first.stats.stop_reason == "interrupted"
    unread = hs.generate(PROMPT, max_new_tokens=12, draft_len=0, stream=True)
    hs.reset()  # superseded before its first piece
    assert unread.stats.stop_reason == "interrupted"


def test_ctrl_c_between_a_tree_decode_and_its_kept_branch_leaves_the_object_usable(model_path, monkeypatch):
    """The tree's prefix and cells stayed in its leaf sequences, and the next tree round built on them."""
    tree = TreeSpec(total_tokens=8, depth=4, top_k=2)
    with HeteroSpec(model_path, DARTER, n_ctx=512, threads=1) as h:
        plain = h.generate(LONG, max_new_tokens=16, draft_len=0).text
        h.reset()
        real, calls = LlamaTarget.keep_branch, {"n": 0}

        def interrupted(self, *args):  # the signal lands during the first round's acceptance, before any
            calls["n"] += 1        # rejected cell is parked (parked cells already made the next prefill reset)
            if calls["n"] == 1:
                raise KeyboardInterrupt
            return real(self, *args)

        monkeypatch.setattr(LlamaTarget, "keep_branch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            h.generate(LONG, max_new_tokens=16, draft_len=4, tree=tree)
        monkeypatch.undo()
        again = h.generate(LONG, max_new_tokens=16, draft_len=4, tree=tree)
        assert again.text == plain and len(again.stats.rounds) > 1


def test_ctrl_c_as_a_prefill_decode_returns_leaves_the_object_usable(hs, plain, monkeypatch):
    """A Ctrl-C landing right after llama_decode returned left cells in the cache that the token list did not
    hold, and every later call failed with 'invalid batch' (a timer's SIGINT did it in 2 of 2 runs)."""
    real = _ffi.check_decode
    calls = {"n": 0}

    def interrupted_once(rc: int) -> None:  # the decode happened; the signal lands as it returns
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real(rc)

    monkeypatch.setattr(_ffi, "check_decode", interrupted_once)
    hs.reset()
    with pytest.raises(KeyboardInterrupt):
        hs.generate(LONG, max_new_tokens=12, draft_len=0)
    monkeypatch.setattr(_ffi, "check_decode", real)
    assert hs.target.kv_pos_max() == hs.target.n_past - 1  # the cache holds exactly the listed tokens
    assert hs.generate(LONG, max_new_tokens=12, draft_len=0).text == plain[LONG]


def test_arguments_of_the_wrong_kind_are_named(hs, plain, model_path):
    hs.reset()
    assert hs.generate(PROMPT, max_new_tokens=12, draft_len=0, stop="\n\n").text == hs.generate(
        PROMPT, max_new_tokens=12, draft_len=0, stop=["\n\n"]).text  # one stop string, not its characters
    cases = [
        (lambda: hs.generate([1, hs.target.n_vocab]), f"token id {hs.target.n_vocab} is outside"),
        (lambda: hs.generate([1, -1]), "token id -1 is outside"),
        (lambda: hs.generate(b"hello"), "not bytes"),
        (lambda: hs.generate(PROMPT, max_new_tokens=2.5), "max_new_tokens must be a whole number"),
        (lambda: hs.generate(PROMPT, draft_len=2.5), "draft length"),
        (lambda: hs.generate(PROMPT, sampling={"temperature": 0.7}), "sampling must be a SamplingConfig"),
        (lambda: hs.generate(PROMPT, stop=5), "stop must be"),
        (lambda: hs.chat("hello"), "messages must be a list"),
        (lambda: hs.chat([("user", "hi")]), r"messages\[0\] must be a dict"),
        (lambda: hs.chat([{"role": "user", "content": None}]), r"messages\[0\] must be a dict"),
        (lambda: HeteroSpec(model_path, threads=MAX_THREADS + 1), "threads must be a whole number"),
        (lambda: HeteroSpec(model_path, threads=1.5), "threads must be a whole number"),
        (lambda: HeteroSpec(model_path, n_ctx=0), "n_ctx must be a whole number >= 16"),
        (lambda: HeteroSpec(model_path, denoise={"threshold": 0.1}), "denoise must be a DenoiseConfig"),
    ]
    for call, message in cases:
        with pytest.raises(HeteroSpecError, match=message):  # ConfigError included: it is a HeteroSpecError
            call()
    assert issubclass(ConfigError, HeteroSpecError)
    hs.reset()
    assert hs.generate(PROMPT, max_new_tokens=12, draft_len=0).text == plain[PROMPT]  # still usable


def test_batch_bad_prompts_and_interrupts_leave_the_generator_usable(model_path, monkeypatch):
    with BatchGenerator(model_path, slots=2, n_ctx=256, threads=1, drafts=False) as bg:
        good = [o.text for o in bg.generate([PROMPT, OTHER], max_new_tokens=8, progress=False)]
        n_vocab = bg.target.n_vocab
        with pytest.raises(HeteroSpecError, match=f"prompt 1: token id {n_vocab} is outside"):
            bg.generate([PROMPT, [1, n_vocab]], max_new_tokens=8, progress=False)
        with pytest.raises(HeteroSpecError, match=r"a list of prompts \(for one, \[prompt\]\)"):
            bg.generate("Hi!", max_new_tokens=8, progress=False)
        for bad in (2.5, 0):
            with pytest.raises(HeteroSpecError, match="max_new_tokens must be a whole number"):
                bg.generate([PROMPT], max_new_tokens=bad, progress=False)
        with pytest.raises(HeteroSpecError, match=r"conversations\[1\]: empty prompt"):
            bg.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": " "}]], progress=False)
        real_step, steps = bg.engine.step, {"n": 0}

        def interrupted_step():  # a Ctrl-C in the middle of a job
            steps["n"] += 1
            if steps["n"] == 3:
                raise KeyboardInterrupt
            return real_step()

        monkeypatch.setattr(bg.engine, "step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            bg.generate([PROMPT, OTHER], max_new_tokens=8, progress=False)
        monkeypatch.undo()
        assert bg.engine.idle
        assert [o.text for o in bg.generate([PROMPT, OTHER], max_new_tokens=8, progress=False)] == good
    with pytest.raises(HeteroSpecError, match="slots must be a whole number"):
        BatchGenerator(model_path, slots=0)
