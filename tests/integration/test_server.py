"""``hetero-spec serve`` on loopback with the real GGUF: the official ``openai`` client, load, bad input.

Servers are real: ``python -m hetero_spec serve ... --port 0`` subprocesses (one per module
fixture, stopped by it), plus one uvicorn server in this process where a fault has to be
injected.  Every client call has a timeout; every loop is bounded.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.curves import CHEAP_ROWS  # noqa: E402  (after the skips: the server's extra may be missing)

CLI = [sys.executable, "-m", "hetero_spec"]
KEY = "test-key-123"
CTX = 1024
MAX_BODY = 64 * 1024
STARTUP_S = 180.0
CALL_S = 60.0  # timeout of every client call
PROMPT = "List three colours."
DRAFT = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-eagle.safetensors"
LONG_PROMPT = "1, 2, 3, 4, 5,"  # a raw completion the model keeps counting for hundreds of tokens
LONG_TOKENS = 900


class ServerProcess:
    """``hetero-spec serve`` in a subprocess; stderr (the request log) drained into ``lines``."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CLI, "serve", *map(str, args), "--port", "0"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[str] = []
        self._closed = False
        self._cond = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            line = self.wait_for_line(lambda ln: "listening on http://" in ln, STARTUP_S)
        except BaseException:
            self.stop()
            raise
        self.url = line.split("listening on ", 1)[1].strip()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for_line(self, pred, timeout: float) -> str:
        """The first log line satisfying ``pred``, waiting for new lines (an event, not a sleep)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hit = next((ln for ln in self.lines if pred(ln)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    tail = "\n".join(self.lines[-20:])
                    state = "exited" if self._closed else "running"
                    raise AssertionError(f"no such log line (server {state}):\n{tail}")
                self._cond.wait(left)

    def request_line(self, request_id: str, timeout: float = 30.0) -> str:
        return self.wait_for_line(lambda ln: f" {request_id} " in ln, timeout)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it: a graceful shutdown that exits 0 (killed after 30 s otherwise)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def cli_run(*args: str) -> str:
    proc = subprocess.run([*CLI, "run", *map(str, args)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def chat_body(content: str = PROMPT, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0, **fields}


def assert_error(resp, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The status, and an OpenAI-style error body with no traceback in it."""
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def metric(http, name: str, default: float | None = None) -> float:
    """One sample of /metrics; ``default`` for a labelled series that has not appeared yet."""
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if m is None and default is not None:
        return default
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess(model_path, "--no-draft", "--parallel", 1, "-t", 1, "--ctx", CTX, "--api-key", KEY, "--max-queue", 8,
                        "--queue-timeout", 120, "--max-body", MAX_BODY)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.lines[-20:])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CALL_S) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_S)


@pytest.fixture(scope="module")
def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


# ------------------------------------------------------------------ the openai client
def test_openai_client_greedy_equals_cli_run(client, model_id, model_path):
    resp = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=16, temperature=0)
    text = resp.choices[0].message.content
    assert text and cli_run(model_path, "--no-draft", "-t", 1, "--ctx", CTX, "-p", PROMPT, "-n", 16) == text + "\n"
    u = resp.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert resp.choices[0].finish_reason == ("length" if u.completion_tokens == 16 else "stop")
    stats = resp.model_extra["hetero_spec"]
    assert stats["rounds"] == u.completion_tokens - 1  # plain decoding: the prefill yields the first token
    assert stats["drafted_tokens"] == 0 and stats["mean_accepted_length"] == 1.0 and stats["tokens_per_s"] > 0


def test_text_completion_equals_cli_raw(client, model_id, model_path):
    resp = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    expected = cli_run(model_path, "--no-draft", "--raw", "-t", 1, "--ctx", CTX, "-p", "The capital of France is",
                       "-n", 8)
    assert resp.choices[0].text == expected[:-1] and resp.usage.completion_tokens <= 8


def test_streaming_with_usage_equals_non_streaming(client, model_id):
    full = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len(chunks) >= 4  # role, several pieces, finish, usage: it really streamed


def test_stop_strings(client, model_id):
    ask = dict(model=model_id, messages=[{"role": "user", "content": "Describe the sea in two sentences."}],
               max_tokens=40, temperature=0)
    full = client.chat.completions.create(**ask).choices[0].message.content
    words = full.split()
    assert len(words) > 6
    stop = " " + words[4]  # certainly in the unconstrained output
    cut = client.chat.completions.create(**ask, stop=[stop, "\u2603never"])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.model_extra["hetero_spec"]["stop_reason"] == "stop_string"
    streamed = client.chat.completions.create(**ask, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]


def test_second_turn_reuses_the_conversation(client, model_id):
    """Turn 2 carries turn 1 verbatim, so it costs only its new rows; its text equals a cold run's."""
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    a1 = client.chat.completions.create(model=model_id, messages=turn1, max_tokens=12, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "And a vegetable?"}]
    warm = client.chat.completions.create(model=model_id, messages=turn2, max_tokens=12, temperature=0)
    client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Unrelated."}], max_tokens=2)
    cold = client.chat.completions.create(model=model_id, messages=turn2, max_tokens=12, temperature=0)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens > a1.usage.prompt_tokens


def test_wrong_api_key_is_refused(server, model_id):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=CALL_S)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with httpx.Client(base_url=server.url, timeout=CALL_S) as anon:
        resp = anon.post("/v1/chat/completions", json=chat_body())
        assert_error(resp, 401, code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
        assert_error(anon.get("/v1/models"), 401)
        assert_error(anon.get("/metrics", headers={"Authorization": f"Basic {KEY}"}), 401)
        assert anon.get("/health").json()["status"] == "ok"  # liveness needs no key


# ------------------------------------------------------------------ endpoints, log, metrics
def test_models_health_metrics_and_log_line(server, http, model_id):
    assert model_id and http.get("/health").json() == {"status": "ok", "model": model_id, "queue_depth": 0,
                                                       "busy": False}
    before = metric(http, "hetero_spec_generated_tokens_total")
    ok_before = metric(http, 'hetero_spec_requests_total{endpoint="/v1/chat/completions",status="200"}', 0.0)
    resp = http.post("/v1/chat/completions", json=chat_body(max_tokens=6))
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    rid = resp.headers["x-request-id"]
    assert resp.json()["id"] == f"chatcmpl-{rid}"
    line = server.request_line(rid)
    assert re.search(rf"{rid} POST /v1/chat/completions 200 tokens={usage['prompt_tokens']}\+"
                     rf"{usage['completion_tokens']} stop=\w+ \d+\.\d+s$", line), line
    assert sum(rid in ln for ln in server.lines) == 1
    assert metric(http, "hetero_spec_generated_tokens_total") - before == usage["completion_tokens"]
    assert metric(http, 'hetero_spec_requests_total{endpoint="/v1/chat/completions",status="200"}') == ok_before + 1
    text = http.get("/metrics").text
    for name in ("hetero_spec_tokens_per_second", "hetero_spec_mean_accepted_length", "hetero_spec_queue_depth",
                 "hetero_spec_prefill_seconds_count", "hetero_spec_decode_seconds_count",
                 "hetero_spec_time_to_first_token_seconds_count", "hetero_spec_queue_wait_seconds_count"):
        assert re.search(rf"^{name} ", text, re.M), name


# ------------------------------------------------------------------ bad input
LONG = "word " * 3000


@pytest.mark.parametrize("path,body,status,code,param", [
    ("/v1/chat/completions", b'{"messages": [', 400, "invalid_json", None),
    ("/v1/chat/completions", b"[1, 2]", 400, None, None),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, None, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, None, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None, "messages.0.content"),
    ("/v1/chat/completions", chat_body(max_tokens="8"), 400, None, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_tokens=0), 400, None, "max_tokens"),
    ("/v1/chat/completions", chat_body(temperature=3), 400, None, "temperature"),
    ("/v1/chat/completions", chat_body(n=2), 400, None, "n"),
    ("/v1/chat/completions", chat_body(stop=["a", "b", "c", "d", "e"]), 400, None, "stop"),
    ("/v1/chat/completions", chat_body(content="   "), 400, None, None),
    ("/v1/chat/completions", chat_body(max_tokens=CTX), 400, "context_length_exceeded", "max_tokens"),
    ("/v1/chat/completions", chat_body(content=LONG[:MAX_BODY // 2]), 400, "context_length_exceeded", None),
    ("/v1/chat/completions", chat_body(model="gpt-4o"), 404, "model_not_found", "model"),
    ("/v1/chat/completions", chat_body(content="x" * MAX_BODY), 413, "request_too_large", None),
    ("/v1/completions", {"max_tokens": 4}, 400, "missing_required_parameter", "prompt"),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, 400, None, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, None, None),
    ("/v1/completions", {"prompt": " ", "max_tokens": 4}, 400, None, "prompt"),
    ("/v1/chat/completions", chat_body(temperature=float("nan")), 400, None, "temperature"),
    ("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=5), 400, None, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 3}, 400, None, "logprobs"),
    ("/v1/embeddings", {"input": "x"}, 404, "not_found", None),
])
def test_bad_input_gets_openai_error(http, path, body, status, code, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_error(http.post(path, content=raw, headers={"Content-Type": "application/json"}), status, code, param)


def test_bad_input_without_length_or_method(http):
    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(3):
            yield b" " * (MAX_BODY // 2)

    assert_error(http.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")
    assert_error(http.get("/v1/chat/completions"), 405)
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200  # still serving


def test_streaming_request_refused_before_the_stream(client, model_id):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=CTX, stream=True)
    assert exc.value.status_code == 400 and exc.value.code == "context_length_exceeded"


# ------------------------------------------------------------------ load and disconnects
CONCURRENT = 64
PROMPTS = ["Name a colour.", "Name a fruit.", "Say hello.", "Name a planet.", "Count to three."]


def _client_with_retries(url: str, body: dict, start: threading.Barrier, attempts: int = 60) -> tuple[list[int], dict]:
    """One client: its request, retried after each 429 as Retry-After says, a bounded number of times."""
    statuses: list[int] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CALL_S) as c:
        start.wait(CALL_S)
        for _ in range(attempts):
            resp = c.post("/v1/chat/completions", json=body)
            statuses.append(resp.status_code)
            if resp.status_code != 429:
                return statuses, resp.json()
            assert_error(resp, 429, "rate_limit_exceeded")
            time.sleep(min(float(resp.headers["retry-after"]), 5.0))  # back-off the server asked for, capped
    return statuses, {}


def test_sixty_four_concurrent_clients(server, http):
    reference = {p: http.post("/v1/chat/completions", json=chat_body(p, max_tokens=8)).json() for p in PROMPTS}
    rss_before = server.rss_kib()
    start = threading.Barrier(CONCURRENT)
    bodies = [chat_body(PROMPTS[i % len(PROMPTS)], max_tokens=8) for i in range(CONCURRENT)]
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(_client_with_retries, server.url, b, start) for b in bodies]
        results = [f.result(timeout=600) for f in futures]
    for body, (statuses, out) in zip(bodies, results):
        assert statuses[-1] == 200 and set(statuses[:-1]) <= {429}, statuses
        expected = reference[body["messages"][0]["content"]]
        assert out["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert out["usage"] == expected["usage"]
    assert any(429 in s for s, _ in results), f"{CONCURRENT} simultaneous clients never filled a queue of 8"
    assert metric(http, "hetero_spec_queue_depth") == 0 and metric(http, "hetero_spec_busy") == 0
    rss_after = server.rss_kib()
    assert abs(rss_after - rss_before) <= 0.10 * rss_before, (rss_before, rss_after)


KILLED_CLIENT = textwrap.dedent("""
    import json, sys, httpx
    url, key, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer " + key},
                      timeout=60) as resp:
        print(resp.headers["x-request-id"], flush=True)
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                print("FIRST", flush=True)
                sys.stdin.readline()  # block until the test kills us
""")


def test_client_killed_mid_stream_cancels_its_generation(server, http):
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url, KEY, LONG_PROMPT, str(LONG_TOKENS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        rid = client.stdout.readline().strip()
        assert client.stdout.readline().strip() == "FIRST"  # generating now
    finally:
        client.kill()
        client.wait(30)
    line = server.request_line(rid, timeout=30)
    m = re.search(r" 499 tokens=\d+\+(\d+) stop=cancelled ", line)
    assert m, line
    assert 0 < int(m.group(1)) < LONG_TOKENS // 4, line  # stopped right after the kill, long before the end
    nxt = http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert nxt.status_code == 200 and nxt.json()["hetero_spec"]["queue_s"] < 1.0
    assert metric(http, "hetero_spec_busy") == 0 and metric(http, "hetero_spec_queue_depth") == 0
    assert metric(http, 'hetero_spec_requests_total{endpoint="/v1/completions",status="499"}') >= 1


def test_serve_without_a_draft_copies_from_the_text_and_stays_exact(model_path):
    """No DRAFT and no --no-draft: auto drafts from the suffix structure over the prompt and the answer,
    and the greedy text is still plain decoding's."""
    from tests.curves import cheap_rows_cached

    prompt = "Repeat this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa."
    with cheap_rows_cached(model_path, 1):  # copying pays whatever this machine's t(n) (tests/curves.py)
        srv = ServerProcess(model_path, "--parallel", 1, "-t", 1, "--ctx", CTX)
        try:
            with httpx.Client(base_url=srv.url, timeout=CALL_S) as c:
                resp = c.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=48))
            assert resp.status_code == 200, resp.text
            body = resp.json()
        finally:
            assert srv.stop() == 0, "\n".join(srv.lines[-20:])
    expected = cli_run(model_path, "--no-draft", "-t", 1, "--ctx", CTX, "-p", prompt, "-n", 48)
    assert body["choices"][0]["message"]["content"] + "\n" == expected
    stats = body["hetero_spec"]
    assert stats["suffix_rounds"] > 0 and stats["accepted_tokens"] > 0, stats


@pytest.fixture(scope="module")
def tight_server(model_path):
    srv = ServerProcess(model_path, "--no-draft", "--parallel", 1, "-t", 1, "--ctx", CTX, "--max-queue", 1,
                        "--queue-timeout", 2)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.lines[-20:])


def test_queue_bound_429_and_queue_timeout_503(tight_server):
    srv = tight_server
    with httpx.Client(base_url=srv.url, timeout=CALL_S) as c:
        body = {"prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert any(ln.startswith("data: {") for ln in lines)  # the long one holds the model now
            pool = concurrent.futures.ThreadPoolExecutor(1)
            waiter = pool.submit(c.post, "/v1/chat/completions", json=chat_body(max_tokens=2))
            for _ in range(500):  # bounded: until the second request is queued
                if c.get("/health").json()["queue_depth"] == 1:
                    break
                time.sleep(0.01)
            full = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            err = assert_error(full, 429, "rate_limit_exceeded")
            assert int(full.headers["retry-after"]) >= 1 and "waiting" in err["message"]
            timed_out = waiter.result(timeout=CALL_S)
            pool.shutdown()
            assert_error(timed_out, 503, "queue_timeout")
            assert int(timed_out.headers["retry-after"]) >= 1
            running_id = running.headers["x-request-id"]
        # leaving the stream disconnects: the long generation stops and the model is free again
        assert " stop=cancelled " in srv.request_line(running_id)
        after = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert after.status_code == 200


# ------------------------------------------------------------------ the draft through the server
def test_server_with_draft_equals_plain(model_path, client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=16, temperature=0)
    srv = ServerProcess(model_path, DRAFT, "-k", 3, "--draft-device", "cpu", "--parallel", 1, "-t", 1, "--ctx", CTX)
    try:
        spec = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=CALL_S)
        out = spec.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=16, temperature=0)
    finally:
        srv.stop()
    assert out.choices[0].message.content == plain.choices[0].message.content
    stats = out.model_extra["hetero_spec"]
    assert stats["drafted_tokens"] > 0 and stats["rounds"] < out.usage.completion_tokens
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"] and stats["mean_accepted_length"] >= 1.0


def test_model_that_cannot_load_is_one_line_and_a_nonzero_exit(tmp_path):
    """The model loads on the worker thread; its failure still reaches the CLI as one line, before any bind."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc = subprocess.run([*CLI, "serve", bad, "--port", "0", "-t", "1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "broken.gguf" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "listening on" not in proc.stderr


@pytest.mark.parametrize("slots", [1, 2])
def test_a_context_too_short_for_any_chat_is_said_at_start(model_path, slots):
    """``--ctx 16`` started a server on which every chat request failed, with nothing said at start; the
    warning names the template's length, and text completions still work."""
    srv = ServerProcess(model_path, "--no-draft", "--no-lookup", "--parallel", slots, "-t", 1, "--ctx", 16)
    try:
        warning = srv.wait_for_line(lambda ln: "WARNING" in ln and "--ctx 16 is too short for any chat" in ln, 5)
        needed = int(re.search(r"takes (\d+) tokens", warning).group(1))
        with httpx.Client(base_url=srv.url, timeout=CALL_S) as c:
            refused = c.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=1))
            assert f"{needed} " in assert_error(refused, 400, "context_length_exceeded")["message"]  # its length
            text = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
            assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] >= 1, text.text
    finally:
        assert srv.stop() == 0
    roomy = ServerProcess(model_path, "--no-draft", "--no-lookup", "--parallel", slots, "-t", 1, "--ctx", needed + 1)
    try:
        assert not [ln for ln in roomy.lines if "too short for any chat" in ln]
    finally:
        assert roomy.stop() == 0


def test_second_ctrl_c_stops_at_once_in_one_line_and_exits_zero(model_path):
    """The first Ctrl-C waits for the request in flight; a second one cuts it at once, as uvicorn does, and
    says so in one line: the cut request gets its log line, and no cancellation's traceback is printed."""
    srv = ServerProcess(model_path, "--no-draft", "--parallel", 1, "-t", 1, "--ctx", CTX)
    first = threading.Event()

    def stream() -> None:
        body = {"prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=CALL_S) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        first.set()
        except httpx.HTTPError:  # the cut: the server closes the connection mid-stream
            pass

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    try:
        assert first.wait(CALL_S), "\n".join(srv.lines[-20:])  # generating now
        srv.proc.send_signal(signal.SIGINT)
        srv.wait_for_line(lambda ln: "Waiting for connections to close" in ln, 30)  # the graceful wait
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
    client.join(30)
    srv.wait_for_line(lambda ln: "Finished server process" in ln, 5)
    log = "\n".join(srv.lines)
    assert "stopping now: 1 connection(s) cut" in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    # the connection was closed, not left to the graceful wait's timeout: the handler saw its client leave
    assert "timeout graceful shutdown exceeded" not in log, log
    assert re.search(r" POST /v1/completions 499 tokens=\d+\+\d+ stop=cancelled ", log), log


def test_an_empty_api_key_is_refused_not_served_open(model_path):
    """``--api-key "$KEY"`` with KEY unset gave a server that anyone could use, without a word."""
    proc = subprocess.run([*CLI, "serve", model_path, "--api-key", "", "--port", "0", "-t", "1"], capture_output=True,
                          text=True, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "is empty" in lines[0], proc.stderr
    env = dict(os.environ, HETERO_SPEC_API_KEY="")  # click reads an empty variable as unset
    proc = subprocess.run([*CLI, "serve", model_path, "--port", "0", "-t", "1"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "HETERO_SPEC_API_KEY) is empty" in proc.stderr, proc.stderr


def test_non_loopback_host_warns_and_an_address_that_cannot_be_bound_fails_before_the_load(model_path):
    # 192.0.2.1 (TEST-NET-1) is nobody's address: the warning comes, then the bind fails; nothing is exposed
    proc = subprocess.run([*CLI, "serve", model_path, "--host", "192.0.2.1", "--port", "0", "-t", "1"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "binding to 192.0.2.1: other machines can reach this server" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cannot listen on 192.0.2.1:0")
    with socket.socket() as taken:  # a port in use: one line, and the model is never loaded
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        proc = subprocess.run([*CLI, "serve", model_path, "--port", str(port), "-t", "1"],
                              capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


# ------------------------------------------------------------------ faults (a server in this process)
@pytest.fixture(scope="module")
def inproc(model_path):
    """The same app under uvicorn on a thread, around a HeteroSpec this test can break on purpose."""
    from hetero_spec.api import HeteroSpec
    from hetero_spec.server.app import create_app
    from hetero_spec.server.config import ServerConfig
    from hetero_spec.server.launch import ListeningServer, uvicorn_config

    config = ServerConfig(model_id="inproc", port=0)
    loaded_on: list[str] = []

    def load():
        loaded_on.append(threading.current_thread().name)
        hs = HeteroSpec(model_path, n_ctx=512, threads=1)
        hs._curve = CHEAP_ROWS  # auto's first request prices rows from this, not from seconds of measuring
        return hs

    app = create_app(load, config)
    srv = ListeningServer(uvicorn_config(app, config))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    assert srv.ready.wait(STARTUP_S), "in-process server did not start"
    worker = app.state.worker
    assert loaded_on == ["hetero-spec-worker"]  # built on the thread that decodes, not here nor on uvicorn's
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=CALL_S) as c:
        yield worker.hs, c
    srv.should_exit = True
    thread.join(CALL_S)
    assert not thread.is_alive()
    assert not worker.alive  # the lifespan stopped the worker, which closed the model on its own thread


def _within(seconds: float, condition) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_internal_error_is_a_generic_500_and_the_server_keeps_serving(inproc, monkeypatch, caplog):
    hs, c = inproc

    def broken(*args, **kwargs):
        raise RuntimeError("boom in /very/secret/path")

    with monkeypatch.context() as m, caplog.at_level("INFO", logger="hetero_spec.server"):
        m.setattr(hs, "chat", broken)
        resp = c.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        err = assert_error(resp, 500, "internal_error")
        assert "secret" not in resp.text and "boom" not in err["message"]
        line = f"{resp.headers['x-request-id']} POST /v1/chat/completions 500"
        # the request line is logged once the response has ended, which a loaded machine may let the client
        # see first: wait for it, boundedly, and inside at_level, which captures INFO only while it lasts
        assert _within(5.0, lambda: any(line in r.getMessage() for r in caplog.records))
    logged = [r for r in caplog.records if r.exc_info and "boom in /very/secret/path" in str(r.exc_info[1])]
    assert logged and resp.headers["x-request-id"] in logged[0].getMessage()
    assert c.post("/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200


def test_error_outside_the_model_is_a_generic_500(inproc, monkeypatch, caplog):
    from hetero_spec.server.responses import Shaper

    _, c = inproc

    def broken(self, fin):
        raise KeyError("shaping failed")

    with monkeypatch.context() as m, caplog.at_level("ERROR", logger="hetero_spec.server"):
        m.setattr(Shaper, "full", broken)
        assert_error(c.post("/v1/chat/completions", json=chat_body(max_tokens=2)), 500, "internal_error")
    assert any(r.exc_info and "shaping failed" in str(r.exc_info[1]) for r in caplog.records)
    assert c.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_error_mid_stream_ends_the_stream_with_an_error_event(inproc, monkeypatch):
    hs, c = inproc
    real_chat = type(hs).chat

    def fails_after_one_piece(messages, **kwargs):
        stream = real_chat(hs, messages, **kwargs)
        pieces = iter(stream)

        def one_then_boom():
            yield next(pieces)
            raise RuntimeError("mid-stream failure")

        stream._pieces = one_then_boom()
        return stream

    with monkeypatch.context() as m:
        m.setattr(hs, "chat", fails_after_one_piece)
        with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            assert resp.status_code == 200
            events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    assert any(json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content") for e in events[:-2])
    assert c.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_cancel_hook_stops_the_generation_within_one_round(inproc):
    """The API side of a disconnect: once ``cancel`` says so, no further round runs."""
    hs, _ = inproc
    flag = threading.Event()
    stream = hs.generate(LONG_PROMPT, max_new_tokens=200, stream=True, cancel=flag.is_set)
    seen = 0
    for i, _piece in enumerate(stream):
        assert not flag.is_set(), "a piece came after the cancel"
        if i == 3:
            seen = len(stream.tokens)
            flag.set()
    assert seen > 0 and len(stream.tokens) == seen and stream.stats.stop_reason == "cancelled"


# ------------------------------------------------------------------ --parallel: slots in the batched engine
SLOTS = 3


@pytest.fixture(scope="module")
def slot_server(model_path):
    srv = ServerProcess(model_path, "--no-draft", "-t", 1, "--ctx", CTX, "--api-key", KEY, "--parallel", SLOTS,
                        "--max-queue", 12, "--queue-timeout", 120)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.lines[-20:])


@pytest.fixture(scope="module")
def slot_http(slot_server):
    with httpx.Client(base_url=slot_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=CALL_S) as c:
        yield c


def _ask(client, model_id: str, kind: str, prompt: str, n: int, stream: bool) -> tuple[str, int]:
    """(text, completion tokens) of one greedy request through the openai client."""
    if kind == "chat":
        call = dict(model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
        if not stream:
            r = client.chat.completions.create(**call)
            return r.choices[0].message.content, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(**call, stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0, stream=stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    if not stream:
        return r.choices[0].text, r.usage.completion_tokens
    chunks = list(r)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def test_parallel_greedy_equals_served_alone_at_any_concurrency(client, model_id, slot_server):
    """Every greedy answer from the slots equals the single-sequence server's, bit for bit, with 12 requests
    (chat and text, streamed and not, long and short) arriving at once into 3 slots."""
    cases = [("chat", p, 24) for p in PROMPTS] + [("text", LONG_PROMPT, 40), ("text", "The capital of France is", 8),
                                                   ("chat", "Describe the sea in two sentences.", 40)]
    alone = {c: _ask(client, model_id, *c, stream=False) for c in cases}
    slots = openai.OpenAI(base_url=slot_server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_S)
    jobs = [(c, i % 2 == 1) for i, c in enumerate(cases + cases[:4])]  # 12: as many as 3 slots + 12 waiting hold
    start = threading.Barrier(len(jobs))

    def one(case, stream):
        start.wait(CALL_S)
        return _ask(slots, model_id, *case, stream=stream)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = [f.result(timeout=300) for f in [pool.submit(one, c, s) for c, s in jobs]]
    for (case, stream), out in zip(jobs, got):
        assert out == alone[case], (case, stream)


def test_parallel_health_lists_slots_and_metrics_show_steps(slot_http):
    health = slot_http.get("/health").json()
    assert health["status"] == "ok" and health["busy"] is False and health["queue_depth"] == 0
    assert health["slots"] == [{"id": i, "state": "idle"} for i in range(SLOTS)]
    assert slot_http.post("/v1/chat/completions", json=chat_body(max_tokens=6)).status_code == 200
    assert metric(slot_http, "hetero_spec_slots") == SLOTS
    assert metric(slot_http, "hetero_spec_slot_occupancy") == 0
    steps = metric(slot_http, "hetero_spec_decode_steps_total")
    assert steps > 0 and metric(slot_http, "hetero_spec_step_rows_count") == steps
    assert metric(slot_http, 'hetero_spec_rows_total{kind="plain"}') > 0
    assert metric(slot_http, 'hetero_spec_rows_total{kind="prompt"}') > 0
    assert metric(slot_http, 'hetero_spec_rows_total{kind="draft"}') == 0  # --no-draft: no lookup rows either


def test_parallel_turn_two_gets_its_cells_back_after_every_slot_moved_on(client, model_id, slot_server, slot_http):
    """Turn 1 of a conversation, then as many other requests at once as there are slots (one of them takes turn
    1's slot, whose cells go to the host-memory prompt cache): turn 2 finds its start there, and its answer
    equals the one-sequence server's."""
    slots = openai.OpenAI(base_url=slot_server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_S)
    turn1 = [{"role": "user", "content": "Describe a lighthouse at night in three sentences."}]
    a1 = slots.chat.completions.create(model=model_id, messages=turn1, max_tokens=24, temperature=0)
    start = threading.Barrier(SLOTS)

    def other(prompt: str) -> str:
        start.wait(CALL_S)
        return _ask(slots, model_id, "chat", prompt, 32, stream=False)[0]

    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        list(pool.map(other, PROMPTS[:SLOTS]))
    assert metric(slot_http, "hetero_spec_prompt_cache_bytes") > 0
    restored = metric(slot_http, "hetero_spec_restored_prompt_tokens_total")
    turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                     {"role": "user", "content": "Now in one sentence."}]
    warm = slots.chat.completions.create(model=model_id, messages=turn2, max_tokens=16, temperature=0)
    assert metric(slot_http, "hetero_spec_restored_prompt_tokens_total") - restored >= a1.usage.prompt_tokens // 2
    alone = client.chat.completions.create(model=model_id, messages=turn2, max_tokens=16, temperature=0)
    assert warm.choices[0].message.content == alone.choices[0].message.content


def test_parallel_client_killed_mid_stream_frees_its_slot(slot_server, slot_http):
    client = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, slot_server.url, KEY, LONG_PROMPT,
                               str(LONG_TOKENS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        rid = client.stdout.readline().strip()
        assert client.stdout.readline().strip() == "FIRST"
    finally:
        client.kill()
        client.wait(30)
    line = slot_server.request_line(rid, timeout=30)
    m = re.search(r" 499 tokens=\d+\+(\d+) stop=cancelled ", line)
    assert m and 0 < int(m.group(1)) < LONG_TOKENS // 4, line
    assert all(s["state"] == "idle" for s in slot_http.get("/health").json()["slots"])
    assert metric(slot_http, "hetero_spec_busy") == 0


def test_parallel_sixty_four_clients_bounded_queue(slot_server, slot_http):
    """More clients than slots + queue: refusals are JSON 429s, every request is served in the end, the
    answers are the ones served alone, and resident memory stays where it was."""
    reference = {p: slot_http.post("/v1/chat/completions", json=chat_body(p, max_tokens=8)).json() for p in PROMPTS}
    rss_before = slot_server.rss_kib()
    start = threading.Barrier(CONCURRENT)
    bodies = [chat_body(PROMPTS[i % len(PROMPTS)], max_tokens=8) for i in range(CONCURRENT)]
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        results = [f.result(timeout=600) for f in
                   [pool.submit(_client_with_retries, slot_server.url, b, start) for b in bodies]]
    for body, (statuses, out) in zip(bodies, results):
        assert statuses[-1] == 200 and set(statuses[:-1]) <= {429}, statuses
        expected = reference[body["messages"][0]["content"]]
        assert out["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert any(429 in s for s, _ in results)
    assert metric(slot_http, "hetero_spec_queue_depth") == 0 and metric(slot_http, "hetero_spec_busy") == 0
    rss_after = slot_server.rss_kib()
    assert abs(rss_after - rss_before) <= 0.10 * rss_before, (rss_before, rss_after)


def test_parallel_with_a_draft_model_stays_exact(model_path, http):
    """``serve MODEL DRAFT``: 4 slots by default with a draft model too, the draft model drafting for every slot
    (it says so at start), and concurrent greedy answers equal the one-sequence server's."""
    alone = [http.post("/v1/chat/completions", json=chat_body(p, max_tokens=32)).json() for p in PROMPTS]
    srv = ServerProcess(model_path, DRAFT, "-t", 1, "--ctx", CTX)
    try:
        srv.wait_for_line(lambda line: "draft model" in line and "4 slots" in line, timeout=30)
        with httpx.Client(base_url=srv.url, timeout=CALL_S) as c:
            assert len(c.get("/health").json()["slots"]) == 4
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(pool.map(lambda p: c.post("/v1/chat/completions", json=chat_body(p, max_tokens=32)).json(),
                                    PROMPTS))
            for a, b in zip(alone, got):
                assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    finally:
        assert srv.stop() == 0, "\n".join(srv.lines[-20:])


@pytest.mark.parametrize("flag, error", [("--tree", "error: --tree drafts for one sequence at a time"),
                                         ("--no-suffix", "error: --no-suffix is for one sequence at a time")])
def test_parallel_with_a_one_sequence_option_is_refused_in_one_line(model_path, flag, error):
    proc = subprocess.run([*CLI, "serve", model_path, DRAFT, "--parallel", "2", flag, "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(error) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_default_serve_is_four_slots_with_priced_lookup_and_stays_exact(model_path, http, slot_http):
    """``serve MODEL`` with no draft model: 4 slots (llama-server's default), prompt-lookup rows priced on the
    batch, and greedy answers equal to the one-sequence server's.  Whether copies pay beside three other
    generating slots depends on this machine's measured row costs; the same request again, alone, copies its
    past answer (a match of its full length, one slot generating), checked unverified until its match class has
    shown itself right (``Engine._shadowed``), which pays wherever a few rows cost less than as many decodes.
    A seeded sampled request does the same, and its answer is the one the slots give it with no drafts at all
    (``--no-draft``)."""
    prompt = "Repeat this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa."
    cases = [prompt, *PROMPTS[:3]]
    alone = [http.post("/v1/chat/completions", json=chat_body(p, max_tokens=48)).json() for p in cases]
    srv = ServerProcess(model_path, "-t", 1, "--ctx", CTX)
    try:
        with httpx.Client(base_url=srv.url, timeout=CALL_S) as c:
            assert len(c.get("/health").json()["slots"]) == 4
            with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
                got = list(pool.map(lambda p: c.post("/v1/chat/completions", json=chat_body(p, max_tokens=48)).json(),
                                    cases))
            for a, b in zip(alone, got):
                assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
            before = metric(c, "hetero_spec_accepted_rows_total")
            again = c.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=48)).json()
            assert again["choices"][0]["message"]["content"] == alone[0]["choices"][0]["message"]["content"]
            assert metric(c, "hetero_spec_accepted_rows_total") > before  # the repeat copied its past answer
            sampled = chat_body(prompt, max_tokens=48, temperature=0.8, seed=11)
            undrafted = slot_http.post("/v1/chat/completions", json=sampled).json()
            first, repeat = (c.post("/v1/chat/completions", json=sampled).json() for _ in range(2))
            for r in (first, repeat):
                assert r["choices"][0]["message"]["content"] == undrafted["choices"][0]["message"]["content"]
            assert undrafted["hetero_spec"]["drafted_tokens"] == 0 and repeat["hetero_spec"]["accepted_tokens"] > 0
    finally:
        assert srv.stop() == 0, "\n".join(srv.lines[-20:])
