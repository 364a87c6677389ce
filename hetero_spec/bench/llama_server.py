"""llama.cpp's own speculative decoding as bench runs: one ``llama-server`` per method, over loopback.

The binaries come from ``scripts/build_llama_cpp.sh``: the llama.cpp commit vendored in the
llama-cpp-python we pin, built with the same options as our bindings.  Each method starts one
server (one slot) with the bench's target file, threads, context, 32-row micro-batches, KV cell
type and flash-attention setting, and sends every prompt as token ids to ``/completion``
(greedy: temperature 0, penalties off, no prompt cache), asking for the generated ids back, so
outputs are compared with ``raw`` id for id.

Timing is the server's own (``timings``), like for like with the in-process methods:
``prompt_ms`` runs from the slot starting the prompt to the first generated token (the
harness's ``prefill_s``), ``predicted_ms`` from there to the last token over n - 1 decode
steps, so wall = prompt_ms + predicted_ms and decode tok/s = (n - 1) / predicted_ms, exactly the
harness's conventions.  HTTP and JSON costs fall outside (they are in ``engine.client_wall_s``).
Draft statistics (drafted, accepted, verification steps) come from the server's /metrics
counters, differenced per request.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import HeteroSpecError
from .baselines import BenchTarget, RunResult

BIN_ENV = "HETERO_SPEC_LLAMA_CPP_BIN"
SERVER = "llama-server"
BUILD_HINT = "run `bash scripts/build_llama_cpp.sh` once (several minutes on 2 cores)"
MICRO_BATCH = 32  # the batch-invariant micro-batch every method decodes with (README: Exactness)
# llama-server must fit the sampled token plus a whole draft in one logical batch (it asserts so:
# ngram-simple drafts up to 48 tokens by default); llama.cpp splits it into 32-row micro-batches,
# which is what decides the numbers.
LOGICAL_BATCH = 512


class MethodUnavailable(HeteroSpecError):
    """A bench method cannot run here; the message says why and goes into the report."""


def tools_dir() -> Path:
    """Where the built llama.cpp tools are: ``$HETERO_SPEC_LLAMA_CPP_BIN`` or the build script's cache."""
    env = os.environ.get(BIN_ENV)
    if env:
        return Path(env)
    from ..target._ffi import PINNED_VERSION

    cache = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")))
    return cache / "hetero-spec" / f"llama.cpp-{PINNED_VERSION}" / "bin"


def find_tool(name: str) -> Path:
    path = tools_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise MethodUnavailable(f"{name} is not built at {path.parent}: {BUILD_HINT}")
    return path


@dataclass(frozen=True)
class ServerMethod:
    """One llama.cpp method: the speculative arguments it adds to the common server command."""

    spec_args: tuple[str, ...]
    needs: str | None = None  # the file option it needs ("llama_draft_model" / "eagle3_gguf"), if any


def spec_args(method: ServerMethod, bt: BenchTarget) -> list[str]:
    """The method's llama-server arguments, with its draft file filled in; unavailable without it."""
    args = list(method.spec_args)
    if method.needs is not None:
        path = getattr(bt, method.needs)
        option = "--" + method.needs.replace("_", "-")
        if path is None:
            raise MethodUnavailable(f"no {option} given")
        if not Path(path).is_file():
            raise MethodUnavailable(f"{option} {path} does not exist")
        args += ["-md", str(path), "--spec-draft-n-max", str(bt.k), "-td", str(bt.threads), "-tbd", str(bt.threads)]
    return args


def server_command(binary: Path, bt: BenchTarget, kv_type: str, port: int, extra: list[str]) -> list[str]:
    """llama-server with everything the in-process methods share: file, threads, context, 32-row
    micro-batches, KV cells, flash attention AUTO (llama.cpp's default, as for the raw loop), one
    slot, no prompt caches, and the kernels this machine allows (``target/kernels.py``: the server
    inherits this process's AMX denial, and gets ``--no-repack`` where the extra buffer types are off)."""
    from ..target.kernels import apply_kernel_plan

    return [
        str(binary), "-m", str(bt.model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(bt.threads), "-tb", str(bt.threads), "-c", str(bt.n_ctx), "-np", "1",
        "-b", str(LOGICAL_BATCH), "-ub", str(MICRO_BATCH), "-ctk", kv_type, "-ctv", kv_type, "-fa", "auto",
        "-ngl", "0", "--metrics", "--slots", "--no-webui", "--cache-ram", "0", "--no-cache-prompt",
        *apply_kernel_plan().tool_args(), *extra, *bt.llama_args,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process; ``post`` and ``metrics`` talk to it, ``close`` ends it."""

    def __init__(self, cmd: list[str], port: int, *, startup_s: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix="hetero-spec-llama-server-", suffix=".log")[1])
        self.cmd = cmd
        self.failed = False  # a request failed: the log is kept for the error message that points at it
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(startup_s)
        except BaseException:
            self.close(keep_log=True)  # the error message points at it
            raise

    def _wait_ready(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MethodUnavailable(f"llama-server exited with code {self.proc.returncode}: {self.last_error()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise MethodUnavailable(f"llama-server did not become ready in {startup_s:.0f} s (log: {self.log})")

    def last_error(self) -> str:
        """The most telling line of the server's log (an error line if there is one)."""
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower() or "abort" in ln.lower()]
        return (errors or lines or ["(no output)"])[-1][:300] + f" (log: {self.log})"

    def post(self, path: str, payload: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            self.failed = True
            raise HeteroSpecError(f"llama-server {path}: HTTP {exc.code}: {exc.read()[:300]!r} (log: {self.log})") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            self.failed = True
            raise HeteroSpecError(f"llama-server {path} failed ({exc}): {self.last_error()}") from None

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def speculative(self) -> bool:
        """Whether the slot really speculates: llama-server logs a draft it cannot use and then
        decodes without it (an ordinary GGUF given as an EAGLE-3 draft starts a plain server)."""
        return all(slot.get("speculative", False) for slot in self.get("/slots"))

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters, ``llamacpp:`` prefix dropped."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:") and "{" not in line:
                name, value = line[len("llamacpp:"):].split()
                out[name] = float(value)
        return out

    def close(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not (keep_log or self.failed):
            self.log.unlink(missing_ok=True)


_DRAFT_COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                   "spec_decode_num_drafts_total")


def completion_request(prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Greedy, ids in and out, nothing cached between prompts (every method prefills from scratch)."""
    return {
        "prompt": prompt, "n_predict": max_new_tokens, "temperature": 0.0, "samplers": ["temperature"],
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
        "cache_prompt": False, "return_tokens": True, "stream": False,
    }


def run_result(out: dict[str, Any], client_wall_s: float, drafts: dict[str, float], detokenize) -> RunResult:
    """A /completion answer as a RunResult, timed by the server (see the module docstring)."""
    t = out["timings"]
    tokens = [int(x) for x in out["tokens"]]
    prefill_s = t["prompt_ms"] / 1e3
    engine = {"client_wall_s": client_wall_s, "prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"],
              "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"], "stop_type": out.get("stop_type"),
              "drafted": int(drafts.get("spec_decode_num_draft_tokens_total", 0)),
              "accepted": int(drafts.get("spec_decode_num_accepted_tokens_total", 0)),
              "verify_steps": int(drafts.get("spec_decode_num_drafts_total", 0))}
    if len(tokens) != t["predicted_n"]:
        raise HeteroSpecError(f"llama-server returned {len(tokens)} ids for {t['predicted_n']} predicted tokens")
    return RunResult(detokenize(tokens), len(tokens), prefill_s + t["predicted_ms"] / 1e3, tokens=tokens,
                     prefill_s=prefill_s, engine=engine)


class LlamaServerRun:
    """A bench runner on one llama-server.  ``detokenize`` renders ids as the harness's other methods do
    (hetero-spec's own detokenizer, end-of-generation ids dropped), so texts are comparable too."""

    def __init__(self, bt: BenchTarget, method: ServerMethod, kv_type: str, detokenize) -> None:
        extra = spec_args(method, bt)  # unavailable before anything starts
        port = free_port()
        self.server = LlamaServer(server_command(find_tool(SERVER), bt, kv_type, port, extra), port)
        if method.spec_args and not self.server.speculative():
            why = self.server.last_error()
            self.server.close(keep_log=True)
            raise MethodUnavailable(f"llama-server started without speculation: {why}")
        self.detokenize = detokenize

    def run(self, prompt: list[int], max_new_tokens: int) -> RunResult:
        before = self.server.metrics()
        t0 = time.perf_counter()
        out = self.server.post("/completion", completion_request(prompt, max_new_tokens))
        client_wall = time.perf_counter() - t0
        after = self.server.metrics()
        drafts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _DRAFT_COUNTERS}
        return run_result(out, client_wall, drafts, self.detokenize)

    def close(self) -> None:
        self.server.close()


__all__ = ["LlamaServerRun", "ServerMethod", "MethodUnavailable", "find_tool", "tools_dir", "server_command",
           "spec_args", "completion_request", "run_result"]
