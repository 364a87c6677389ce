"""The server's pure parts: the bounded queue, request validation, error mapping, response shapes."""
from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from hetero_spec.records import Round, RunStats  # noqa: E402
from hetero_spec.server.config import ServerConfig  # noqa: E402
from hetero_spec.server.errors import validation_error  # noqa: E402
from hetero_spec.server.events import Finished  # noqa: E402
from hetero_spec.server.queue import Job, QueueClosed, QueueFull, RequestQueue  # noqa: E402
from hetero_spec.server.requests import ChatRequest, CompletionRequest  # noqa: E402
from hetero_spec.server.responses import Shaper  # noqa: E402


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def job(loop, name: str = "j") -> Job:
    return Job(name, None, loop)


# ------------------------------------------------------------------ queue
def test_queue_holds_max_waiting_behind_the_running_one(loop):
    q = RequestQueue(2)
    jobs = [job(loop, str(i)) for i in range(4)]
    for j in jobs[:3]:  # idle worker: the first one is about to run, two may wait behind it
        q.submit(j)
    with pytest.raises(QueueFull):
        q.submit(jobs[3])
    assert q.take() is jobs[0] and q.running is jobs[0] and q.depth == 2
    with pytest.raises(QueueFull):
        q.submit(jobs[3])
    q.done(jobs[0])
    q.submit(jobs[3])  # the worker is between jobs: room for one more
    assert [q.take() for _ in range(3)] == jobs[1:]


def test_withdraw_and_take_never_both_win(loop):
    q = RequestQueue(4)
    a, b = job(loop, "a"), job(loop, "b")
    q.submit(a)
    q.submit(b)
    assert q.withdraw(b) and not q.withdraw(b)
    assert q.take() is a and not q.withdraw(a)  # running: too late to withdraw
    assert q.depth == 0


def test_take_blocks_until_work_or_close(loop):
    q = RequestQueue(1)
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.take()))
    t.start()
    a = job(loop)
    q.submit(a)
    t.join(10)
    assert got == [a] and a.started_at is not None and a.queue_s >= 0
    q.done(a)
    t = threading.Thread(target=lambda: got.append(q.take()))
    t.start()
    assert q.close() == []
    t.join(10)
    assert not t.is_alive() and got[-1] is None and not a.cancelled.is_set()
    with pytest.raises(QueueClosed):
        q.submit(job(loop))


def test_close_cancels_the_running_job(loop):
    q = RequestQueue(1)
    a = job(loop)
    q.submit(a)
    assert q.take() is a
    q.close()
    assert a.cancelled.is_set()


def test_close_hands_back_the_jobs_that_never_started(loop):
    q = RequestQueue(3)
    jobs = [job(loop, str(i)) for i in range(3)]
    for j in jobs:
        q.submit(j)
    assert q.close() == jobs and q.depth == 0


# ------------------------------------------------------------------ requests
def test_chat_request_is_strict_and_maps_roles():
    req = ChatRequest.model_validate_json(
        '{"messages": [{"role": "developer", "content": "Be brief."},'
        ' {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],'
        ' "max_tokens": 5, "max_completion_tokens": 7, "stop": "x"}')
    assert [m.as_template_message() for m in req.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert req.token_limit == 7 and req.stop_strings() == ("x",)
    for bad in ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}',
                '{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
                '{"messages": [{"role": "tool", "content": "x"}]}',
                '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
                '{"messages": [{"role": "user", "content": "x"}], "n": 3}',
                '{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}'):
        with pytest.raises(ValidationError):
            ChatRequest.model_validate_json(bad)


def test_sampling_defaults_and_greedy_cases():
    req = ChatRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}]}')
    s = req.sampling(fresh_seed=1234)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.8, 0.95, 40, 0.05, 1234)
    assert ChatRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}], "top_p": 0}'
                                           ).sampling(1).greedy
    seeded = ChatRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}], "seed": 7}')
    assert seeded.sampling(1).seed == 7


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate_json('{"prompt": ["one"]}').prompt == "one"
    assert CompletionRequest.model_validate_json('{"prompt": [1, 2, 3]}').prompt == [1, 2, 3]
    for bad in ('{"prompt": ["a", "b"]}', '{"prompt": []}', '{"prompt": 5}'):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate_json(bad)


def test_validation_errors_become_openai_errors():
    def first(raw: str):
        with pytest.raises(ValidationError) as exc:
            ChatRequest.model_validate_json(raw)
        return validation_error(exc.value.errors())

    err = first('{"messages": [{"role": "wizard", "content": "x"}]}')
    assert (err.status, err.param, err.type) == (400, "messages.0.role", "invalid_request_error")
    assert first("{nope").code == "invalid_json"
    missing = first("{}")
    assert (missing.code, missing.param) == ("missing_required_parameter", "messages")
    assert set(missing.body()["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------ config and responses
@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                           ("127.0.0.5", True), ("0.0.0.0", False), ("192.168.1.2", False),
                                           ("example.com", False)])
def test_loopback_detection(host, loopback):
    assert ServerConfig(model_id="m", host=host).loopback_only is loopback


def _finished() -> Finished:
    stats = RunStats(prompt_tokens=5, new_tokens=4, prefill_s=0.1, wall_s=0.4, stop_reason="eog")
    for accepted in (2, 0):
        stats.observe(Round(drafted=2, accepted=accepted, emitted=accepted + 1, draft_s=0, verify_s=0, overhead_s=0,
                            bytes_to_target=0, bytes_to_draft=0))
    return Finished("hi", 5, 4, "stop", stats, queue_s=0.01, ttft_s=0.12)


def test_response_shapes_carry_usage_and_speculation_stats():
    fin = _finished()
    full = Shaper("chat", "chatcmpl-1", "m").full(fin)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hi"}
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    hs = full["hetero_spec"]
    assert (hs["rounds"], hs["drafted_tokens"], hs["accepted_tokens"], hs["mean_accepted_length"]) == (2, 4, 2, 2.0)
    text = Shaper("text", "cmpl-1", "m")
    assert text.chunk("x")["choices"][0]["text"] == "x" and text.chunk("x")["object"] == "text_completion"
    chat = Shaper("chat", "chatcmpl-1", "m")
    assert chat.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chat.chunk(None, fin=fin, include_usage=True)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop" and last["usage"] is None
    assert chat.usage_chunk(fin)["choices"] == [] and chat.usage_chunk(fin)["usage"]["total_tokens"] == 9


def test_serve_slots_auto_is_four_with_or_without_a_draft_and_one_with_a_tree():
    """``--parallel auto``: llama-server's 4 slots (the batched engine drafts for each), except that a ``--tree``
    asks for the one-sequence path, which alone drafts trees; a number is taken as given."""
    from hetero_spec.cli import serve_slots

    assert serve_slots(0, tree=False) == 4
    assert serve_slots(0, tree=True) == 1
    assert serve_slots(3, tree=False) == 3 and serve_slots(1, tree=True) == 1
