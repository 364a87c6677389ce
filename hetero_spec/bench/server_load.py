"""``hetero-spec bench server``: what the HTTP server costs.  Tokens/s through ``hetero-spec serve``
against ``hetero-spec run``, latency with concurrent clients, the batched engine against llama-server,
and the time to first token of a conversation's second turn.

    hetero-spec bench server "$(python scripts/default_model.py)" --out bench-server.json

Both sides run at the same thread count: ``-t 0`` (the default) is the default of ``run`` and
``serve`` (every core), which is where a busy thread beside llama.cpp's shows.  Parts 1, 2 and 3
run ``serve --parallel 1`` (one sequence at a time, the reference for exactness; ``--main-parallel``
changes it); part 2b the batched engine.

1. overhead   one sequential client: the same prompts through ``hetero-spec run --stats-json`` (a
              subprocess each) and through the server (a streaming request each), interleaved prompt
              by prompt with the order alternating; medians.  Decode tokens/s: run's own
              ``tokens_per_s``; the server's as the client sees it, (tokens - 1) / (last byte - first
              text).  End to end: tokens / (request sent -> last byte) against run's tokens / (prefill
              + decode).  Greedy texts must match.  Also the server's CPU time by thread over those
              requests, from /proc: the event loop's share (the main thread) and how many threads
              were busy, so a thread spinning beside llama.cpp's shows up.
2. load       N clients at once, each sending R streaming requests back to back: p50/p95 of the
              queue wait (the server's ``hetero_spec.queue_s``) and of the time to first token
              (request sent -> first text, at the client).
2b. batched   the same load, interleaved pass by pass, against ``serve --parallel N`` (the batched
              engine) and llama.cpp's own server with ``-np N`` (continuous batching; built by
              ``scripts/build_llama_cpp.sh``; same threads, KV cells, context and 32-row
              micro-batches), speculation off on both (``--no-draft``; no ``--spec-type``) and on
              (prompt lookup priced on the batch; ``--spec-type ngram-simple`` and ``ngram-mod``).
              Medians over passes of the aggregate tokens/s and the time to first token, and every
              greedy text of ours checked against the one-sequence server's (needs ``load``).
3. turns      per mt_bench conversation: turn 1, then turn 2 (which reuses turn 1's cached prefix),
              another conversation in between, then the same turn 2 again (only the template's
              shared system prefix is reusable): time to first token, warm against cold.
4. interleaved  twice as many mt_bench conversations as the batched part's slots: every turn 1, then
              every turn 2, through ``serve --parallel N`` with its prompt cache in host memory and with
              ``--cache-ram 0``: the second turns' time to first token and prefill, and equal texts.
"""
from __future__ import annotations

import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from pathlib import Path

import click

if TYPE_CHECKING:
    import httpx

from hetero_spec.bench.prompts import shipped_text
from hetero_spec.config import MAX_THREADS

CLI = [sys.executable, "-m", "hetero_spec"]
TIMEOUT_S = 600.0


class Server:
    """``hetero-spec serve`` on 127.0.0.1 with a free port, for the length of a ``with`` block."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([*CLI, "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.url = ""
        for line in self.proc.stderr:  # bounded by the process: it either says where it listens or exits
            if "listening on http://" in line:
                self.url = line.split("listening on ", 1)[1].strip()
                break
        if not self.url:
            raise SystemExit("the server did not start")
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=lambda: self.tail.extend(self.proc.stderr), daemon=True).start()  # keep draining

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # what the server said last, for the failure above
            sys.stderr.write("".join(self.tail))
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_chat(http: "httpx.Client", messages: list[dict], max_tokens: int, sampling: dict | None = None) -> dict:
    """One streaming request, timed at the client: sent, first text, last byte.  ``sampling``: its
    ``temperature`` and ``seed`` (none: greedy)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    t0 = time.perf_counter()
    first = None
    text, stats, usage = [], {}, {}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            stats = chunk.get("hetero_spec", stats)
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    t1 = time.perf_counter()
    n = usage.get("completion_tokens", len(text))  # a server without include_usage: one piece a token
    first = first or t1
    return {"text": "".join(text), "tokens": n, "ttft_s": first - t0, "wall_s": t1 - t0,
            "decode_tps": (n - 1) / (t1 - first) if n > 1 and t1 > first else 0.0, "server": stats}


def run_cli(model: Path, engine: list[str], prompt: str, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stats_path = Path(tmp) / "stats.json"
        proc = subprocess.run([*CLI, "run", str(model), *engine, "-p", prompt, "-n", str(max_tokens),
                               "--stats-json", str(stats_path)], capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode:
            raise SystemExit(proc.stderr)
        stats = json.loads(stats_path.read_text())
    return {"text": proc.stdout[:-1], "tokens": stats["new_tokens"], "decode_tps": stats["tokens_per_s"],
            "e2e_tps": stats["new_tokens"] / stats["wall_s"]}


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid`` so far, from /proc (Linux only; {} elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended in between
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class ThreadCPU:
    """Sums each server thread's CPU time over the server's requests only (run's are not its own)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.used: dict[int, float] = {}
        self.wall = 0.0

    def measure(self, fn):
        before, t0 = thread_cpu_s(self.pid), time.perf_counter()
        result = fn()
        after = thread_cpu_s(self.pid)
        self.wall += time.perf_counter() - t0
        for tid, s in after.items():
            self.used[tid] = self.used.get(tid, 0.0) + s - before.get(tid, 0.0)
        return result

    def summary(self) -> dict:
        total = sum(self.used.values())
        busy = sorted((s for s in self.used.values() if s > 0.01 * self.wall), reverse=True)
        return {"wall_s": self.wall, "cpu_s": total, "event_loop_cpu_s": self.used.get(self.pid, 0.0),
                "event_loop_share": self.used.get(self.pid, 0.0) / total if total else 0.0,
                "busy_threads_cpu_s": busy}


def overhead(http, model, engine, prompts, max_tokens, repeats, server_pid: int) -> dict:
    rows = []
    cpu = ThreadCPU(server_pid)
    for i, prompt in enumerate([p for _ in range(repeats) for p in prompts]):
        msgs = [{"role": "user", "content": prompt}]
        if i % 2:
            srv = cpu.measure(lambda: stream_chat(http, msgs, max_tokens))
            cli = run_cli(model, engine, prompt, max_tokens)
        else:
            cli = run_cli(model, engine, prompt, max_tokens)
            srv = cpu.measure(lambda: stream_chat(http, msgs, max_tokens))
        rows.append({"tokens": srv["tokens"], "same_text": srv["text"] == cli["text"],
                     "run_decode_tps": cli["decode_tps"], "server_decode_tps": srv["decode_tps"],
                     "server_reported_tps": srv["server"].get("tokens_per_s", 0.0),
                     "run_e2e_tps": cli["e2e_tps"], "server_e2e_tps": srv["tokens"] / srv["wall_s"]})
    ratio = [r["server_decode_tps"] / r["run_decode_tps"] for r in rows if r["run_decode_tps"] > 0]
    e2e = [r["server_e2e_tps"] / r["run_e2e_tps"] for r in rows if r["run_e2e_tps"] > 0]
    return {"rows": rows, "median_decode_ratio": statistics.median(ratio), "median_e2e_ratio": statistics.median(e2e),
            "median_run_decode_tps": statistics.median(r["run_decode_tps"] for r in rows),
            "median_server_decode_tps": statistics.median(r["server_decode_tps"] for r in rows),
            "all_texts_equal": all(r["same_text"] for r in rows), "server_threads": cpu.summary()}


def load(url, prompts, clients, per_client, max_tokens, temperature: float = 0.0) -> dict:
    """``clients`` concurrent streaming clients, ``per_client`` requests each, one after another.  With a
    ``temperature``, request i of the load (client by client) is sampled with seed i, so a configuration's texts
    are the same in every run of it: a server that keeps seeded answers whatever it drafts gives each prompt the
    same set of texts with speculation on and off."""
    import httpx

    def one_client(c: int) -> list[dict]:
        # a connection per request: a keep-alive connection the server closes as the next request goes out
        # (seen with llama-server -np 4) would fail that request, on either side
        with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers={"Connection": "close"}) as http:
            out = []
            for r in range(per_client):
                prompt = prompts[(c + r) % len(prompts)]
                sampling = {"temperature": temperature, "seed": c * per_client + r} if temperature > 0 else None
                out.append({**stream_chat(http, [{"role": "user", "content": prompt}], max_tokens, sampling),
                            "prompt": prompt})
            return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    queue = [r["server"].get("queue_s", 0.0) for r in results]  # 0 where the server does not say (llama-server)
    ttft = [r["ttft_s"] for r in results]
    texts: dict[str, set[str]] = {}
    for r in results:
        texts.setdefault(r["prompt"], set()).add(r["text"])
    return {"clients": clients, "requests": len(results), "queue_wait_s": pct(queue), "ttft_s": pct(ttft),
            "aggregate_tps": sum(r["tokens"] for r in results) / wall,
            "texts": {p: sorted(t) for p, t in texts.items()}}


def turns(http, conversations, max_tokens) -> dict:
    warm, cold = [], []
    for i, (first, second) in enumerate(conversations):
        t1 = [{"role": "user", "content": first}]
        answer = stream_chat(http, t1, max_tokens)["text"]
        t2 = t1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": second}]
        warm.append(stream_chat(http, t2, max_tokens))
        other = conversations[(i + 1) % len(conversations)][0]
        stream_chat(http, [{"role": "user", "content": other}], 4)  # someone else's turn evicts this one
        cold.append(stream_chat(http, t2, max_tokens))
    return {"conversations": len(conversations),
            "warm_ttft_s": pct([w["ttft_s"] for w in warm]), "cold_ttft_s": pct([c["ttft_s"] for c in cold]),
            "warm_prefill_s": pct([w["server"]["prefill_s"] for w in warm]),
            "cold_prefill_s": pct([c["server"]["prefill_s"] for c in cold])}


def interleaved(model: Path, engine: list[str], parallel: int, conversations, max_tokens: int) -> dict:
    """Part 4: more conversations than slots through ``serve --parallel``, turn 1 of every one, then turn 2 of
    every one, so that each second turn finds its slot taken by later conversations: with the prompt cache
    (``--cache-ram``, its default) and without (``--cache-ram 0``).  Time to first token and prefill of the
    second turns, and whether both servers gave the same texts (greedy: they must)."""
    import httpx

    from hetero_spec.config import DEFAULT_CACHE_RAM_MIB

    out: dict = {"parallel": parallel, "conversations": len(conversations)}
    texts = {}
    for label, mib in (("cache", DEFAULT_CACHE_RAM_MIB), ("no_cache", 0)):
        with Server([str(model), *engine, "--parallel", str(parallel), "--cache-ram", str(mib)]) as srv, \
                httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as http:
            stream_chat(http, [{"role": "user", "content": "Hi"}], 4)  # warm-up
            firsts = [[{"role": "user", "content": first}] for first, _ in conversations]
            answers = [stream_chat(http, turn, max_tokens)["text"] for turn in firsts]
            seconds = [stream_chat(http, turn + [{"role": "assistant", "content": a}, {"role": "user", "content": s}],
                                   max_tokens) for turn, a, (_, s) in zip(firsts, answers, conversations)]
            restored = re.search(r"^hetero_spec_restored_prompt_tokens_total (\S+)$", http.get("/metrics").text, re.M)
        texts[label] = answers + [r["text"] for r in seconds]
        out[label] = {"ttft_s": pct([r["ttft_s"] for r in seconds]),
                      "prefill_s": pct([r["server"]["prefill_s"] for r in seconds]),
                      "restored_prompt_tokens": int(float(restored.group(1))) if restored else 0}
    out["texts_equal"] = texts["cache"] == texts["no_cache"]
    return out


SPEC_OFF, SPEC_ON, SPEC_DRAFT = "off", "on", "draft"


def llama_server_cmd(model: Path, threads: int, ctx: int, parallel: int, port: int, spec: list[str]) -> list[str]:
    """llama-server ``-np parallel`` (continuous batching, its defaults otherwise) as the in-process side runs."""
    from hetero_spec.bench.llama_server import find_tool
    from hetero_spec.target.kernels import apply_kernel_plan
    from hetero_spec.target.llama_target import default_threads

    t = str(threads or default_threads())
    return [str(find_tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", t,
            "-tb", t, "-c", str(ctx * parallel), "-np", str(parallel), "-ub", "32", "-ctk", "q8_0", "-ctv", "q8_0",
            "-fa", "auto", "-ngl", "0", "--no-webui", *apply_kernel_plan().tool_args(), *spec]


def batched_load(model: Path, threads: int, ctx: int, parallel: int, prompts, clients, per_client, max_tokens,
                 repeats: int, reference: dict | None, draft: Path | None = None, temperature: float = 0.0) -> dict:
    """Part 2b: each pass runs every configuration once, the order rotated by one each pass; medians over the
    passes.  With a DRAFT, ours also runs with it (the draft model's chains beside the copies, all priced on the
    batch).

    WHY rotated: in a fixed order each configuration always runs right after the same one, in the same part of
    the pass.  On the 2-core EPYC VM the darter's sampled load, always last (after llama-server's ngram-mod), ran
    at 0.82 and 0.86 times speculation off in two runs, and at 0.93 with the order rotated.

    Greedy, our texts are checked against ``reference`` (one sequence at a time).  Sampled (``temperature``, seeded
    per request), against our slots with speculation off in the same pass: the engine keeps a seeded answer
    whatever it drafts (``Engine._accept``).  llama-server's sampler draws differently, so its texts are not."""
    import httpx

    from hetero_spec.bench.llama_server import LlamaServer, free_port

    ours = ["-t", str(threads), "--ctx", str(ctx), "--parallel", str(parallel), "--max-queue", str(clients)]
    configs = {
        ("hetero-spec", SPEC_OFF): ["--no-draft", *ours],
        ("llama-server", SPEC_OFF): [],
        ("hetero-spec", SPEC_ON): ours,  # no draft model: prompt lookup, priced on the batch
        ("llama-server", "ngram-simple"): ["--spec-type", "ngram-simple"],
        ("llama-server", "ngram-mod"): ["--spec-type", "ngram-mod"],
    }
    if draft is not None:
        configs[("hetero-spec", SPEC_DRAFT)] = [str(draft), "--draft-device", "cpu", *ours]
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in configs}
    order = list(configs.items())
    for p in range(repeats):
        for (server, spec), args in order[p % len(order):] + order[:p % len(order)]:
            if server == "hetero-spec":
                with Server([str(model), *args]) as srv:
                    runs[(server, spec)].append(_warm_load(srv.url, prompts, clients, per_client, max_tokens,
                                                           temperature))
            else:
                port = free_port()
                srv = LlamaServer(llama_server_cmd(model, threads, ctx, parallel, port, args), port)
                try:
                    runs[(server, spec)].append(_warm_load(srv.url, prompts, clients, per_client, max_tokens,
                                                           temperature))
                except httpx.HTTPError as err:  # the peer's failure is a finding, not the end of the run
                    srv.failed = True  # keeps its log
                    runs[(server, spec)].append({"error": f"{type(err).__name__}: {err}"})
                    sys.stderr.write(f"llama-server {' '.join(args)} failed ({err}); its log: {srv.log}\n")
                finally:
                    srv.close()
    out = {"parallel": parallel, "passes": repeats, "temperature": temperature, "clients": clients,
           "requests": clients * per_client, "max_tokens": max_tokens, "configs": []}
    undrafted = runs[("hetero-spec", SPEC_OFF)]
    for (server, spec), all_runs in runs.items():
        rs = [r for r in all_runs if "error" not in r]
        errors = [r["error"] for r in all_runs if "error" in r]
        if not rs:
            out["configs"].append({"server": server, "spec": spec, "errors": errors})
            continue
        entry = {"server": server, "spec": spec, "aggregate_tps": statistics.median(r["aggregate_tps"] for r in rs),
                 "ttft_p50_s": statistics.median(r["ttft_s"]["p50"] for r in rs),
                 "ttft_p95_s": statistics.median(r["ttft_s"]["p95"] for r in rs),
                 "aggregate_tps_passes": [r["aggregate_tps"] for r in rs], "errors": errors}
        if temperature > 0:
            if server == "hetero-spec" and spec != SPEC_OFF:  # seeded: the same texts, pass by pass
                entry["texts_equal_undrafted"] = all(r.get("texts") == u.get("texts")
                                                     for r, u in zip(all_runs, undrafted))
        elif reference is not None:  # greedy: ours must equal one sequence at a time; llama-server's, for the record
            entry["texts_equal_one_sequence"] = all(r["texts"] == reference for r in rs)
        out["configs"].append(entry)
    return out


def peer_of(config: dict, configs: list[dict]) -> dict | None:
    """The llama-server configuration a hetero-spec one is compared with: the same mode (speculation off), else
    llama-server's best n-gram mode of the run (by its median tokens/s)."""
    if config["server"] != "hetero-spec":
        return None
    base = {c["spec"]: c for c in configs if c["server"] == "llama-server" and "aggregate_tps" in c}
    return base.get(config["spec"]) or max((v for k, v in base.items() if k.startswith("ngram")),
                                           key=lambda v: v["aggregate_tps"], default=None)


def paired_ratio(ours: dict, peer: dict) -> float | None:
    """The median over passes of ours / peer's tokens/s in the same pass; None unless both ran every pass.

    WHY beside the ratio of the medians: each pass runs every configuration once, minutes apart at most, so a
    pass's pair shares the host's spell, while the two medians may come from different spells.  On the 2-core
    EPYC VM one configuration's passes spread over 206-283 tokens/s within a run."""
    a, b = ours.get("aggregate_tps_passes") or [], peer.get("aggregate_tps_passes") or []
    if not a or len(a) != len(b) or ours.get("errors") or peer.get("errors"):
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def _warm_load(url: str, prompts, clients, per_client, max_tokens, temperature: float = 0.0) -> dict:
    import httpx

    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        stream_chat(http, [{"role": "user", "content": "Hi"}], 4)  # warm-up
    return load(url, prompts, clients, per_client, max_tokens, temperature)


def pct(values: list[float]) -> dict:
    qs = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else values * 19
    return {"p50": statistics.median(values), "p95": qs[18], "n": len(values)}


PARTS = ("overhead", "load", "batched", "turns", "interleaved")


def _parts(ctx: click.Context, param: click.Parameter, value: str) -> set[str]:
    wanted = {v.strip() for v in value.split(",") if v.strip()}
    unknown = sorted(wanted - set(PARTS))
    if unknown or not wanted:
        raise click.BadParameter(f"choose from {', '.join(PARTS)} (got {value!r})")
    return wanted


@click.command("server")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--threads", "-t", default=0, show_default=True, type=click.IntRange(0, MAX_THREADS),
              help="llama.cpp threads of both run and serve (0: their default, every core)")
@click.option("--ctx", default=4096, show_default=True)
@click.option("--n-prompts", default=8, show_default=True, help="mt_bench prompts for the overhead part")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--repeats", default=2, show_default=True, help="passes over the overhead part's prompts")
@click.option("--clients", default=8, show_default=True)
@click.option("--per-client", default=3, show_default=True, help="requests each concurrent client sends")
@click.option("--load-tokens", default=32, show_default=True, help="max_tokens of the load part's requests")
@click.option("--conversations", default=6, show_default=True)
@click.option("--parts", "wanted", default="overhead,load,turns", show_default=True, callback=_parts,
              help="which parts to run, comma-separated: overhead, load, batched, turns, interleaved")
@click.option("--parallel", default=4, show_default=True, type=click.IntRange(2),
              help="slots of the batched part (ours and llama-server's)")
@click.option("--passes", default=2, show_default=True, type=click.IntRange(1), help="passes of the batched part")
@click.option("--main-parallel", default=1, show_default=True, type=click.IntRange(1, 32),
              help="slots of the server parts 1-3 run against (1: one sequence, the reference of part 2b)")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, 2.0),
              help="the load and batched parts' requests sampled at this temperature, request i with seed i "
                   "(0: greedy)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="write the figures as JSON")
def server_load(model, draft, threads, ctx, n_prompts, max_tokens, repeats, clients, per_client, load_tokens, conversations,
                wanted, parallel, passes, main_parallel, temperature, out):
    """The server against run, concurrent clients, and the batched engine against llama-server -np N (docs/server.md)."""
    try:
        import httpx
    except ImportError:
        raise click.ClickException("bench server needs httpx: pip install 'hetero-spec[server]'") from None
    rows = [json.loads(ln)["turns"] for ln in shipped_text("mt_bench").splitlines() if ln.strip()]
    prompts = [t[0] for t in rows]
    engine = [str(draft), "--draft-device", "cpu"] if draft else ["--no-draft"]
    engine += ["-t", str(threads), "--ctx", str(ctx)]
    # parts 1-3: one sequence at a time (the reference for exactness), unless --main-parallel says otherwise
    with Server([str(model), *engine, "--parallel", str(main_parallel)]) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as http:
        stream_chat(http, [{"role": "user", "content": "Hi"}], 4)  # warm-up
        result = {"model": model.name, "draft": draft.name if draft else None, "threads": threads,
                  "main_parallel": main_parallel, "temperature": temperature,
                  "cpu": cpu_name(), "n_cpus": os.cpu_count()}
        if "overhead" in wanted:
            result["overhead"] = overhead(http, model, engine, prompts[:n_prompts], max_tokens, repeats, srv.proc.pid)
        if "load" in wanted:
            result["load"] = load(srv.url, prompts, clients, per_client, load_tokens, temperature)
        if "turns" in wanted:
            result["turns"] = turns(http, [(t[0], t[1]) for t in rows if len(t) > 1][:conversations], max_tokens)
    if "batched" in wanted:
        if "load" not in wanted and temperature == 0:
            click.echo("batched: no load part in this run, so texts are not checked against one sequence", err=True)
        reference = result["load"]["texts"] if "load" in result else None
        result["batched"] = batched_load(model, threads, ctx, parallel, prompts, clients, per_client, load_tokens,
                                         passes, reference, draft, temperature)
    if "interleaved" in wanted:  # twice as many conversations as slots (at least --conversations)
        pairs = [(t[0], t[1]) for t in rows if len(t) > 1]
        result["interleaved"] = interleaved(model, engine, parallel, pairs[:max(conversations, 2 * parallel)],
                                            max_tokens)
    report(result)
    if out:
        out.write_text(json.dumps(result, indent=2))


def cpu_name() -> str:
    """The CPU's model name, family and model (what a figure is quoted with)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    return f"{info.get('model name', 'unknown')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def _load_summary(d: dict, queue: bool = False) -> str:
    """One load phase's line: clients, requests, (queue wait,) time to first token and aggregate speed."""
    wait = (f"queue wait p50 {d['queue_wait_s']['p50']:.3f} s p95 {d['queue_wait_s']['p95']:.3f} s; "
            if queue else "")
    return (f"{d['clients']} clients, {d['requests']} requests: {wait}TTFT p50 {d['ttft_s']['p50']:.3f} s "
            f"p95 {d['ttft_s']['p95']:.3f} s; aggregate {d['aggregate_tps']:.1f} tok/s")


def report(r: dict) -> None:
    sampled = f"; sampled at temperature {r['temperature']}, request i with seed i" if r.get("temperature") else ""
    click.echo(f"model {r['model']}, draft {r['draft']}, threads {r['threads'] or 'default'}; "
               f"{r['cpu']}, {r['n_cpus']} CPUs{sampled}")
    if "overhead" in r:
        o = r["overhead"]
        click.echo(f"1 client over {len(o['rows'])} interleaved runs: decode tokens/s median run "
                   f"{o['median_run_decode_tps']:.1f}, server {o['median_server_decode_tps']:.1f}; server/run median "
                   f"ratio {o['median_decode_ratio']:.3f} (overhead {100 * (1 - o['median_decode_ratio']):+.1f}%), end "
                   f"to end {o['median_e2e_ratio']:.3f}; greedy texts equal: {o['all_texts_equal']}")
        for row in o["rows"]:
            click.echo(f"  {row['tokens']:4d} tok  run {row['run_decode_tps']:6.1f}  server "
                       f"{row['server_decode_tps']:6.1f} (server-side {row['server_reported_tps']:6.1f})  e2e run "
                       f"{row['run_e2e_tps']:6.1f} server {row['server_e2e_tps']:6.1f}")
        th = o["server_threads"]
        click.echo(f"  server CPU over its {th['wall_s']:.1f} s of requests: {th['cpu_s']:.1f} s, event loop "
                   f"{th['event_loop_cpu_s']:.2f} s ({100 * th['event_loop_share']:.1f}%); threads busy over 1% of "
                   f"the time: {', '.join(f'{s:.1f} s' for s in th['busy_threads_cpu_s'])}")
    if "load" in r:
        lo = r["load"]
        click.echo(f"load: {_load_summary(lo, queue=True)}")
    if "batched" in r:
        b = r["batched"]
        click.echo(f"batched, -np/--parallel {b['parallel']}, medians of {b['passes']} interleaved passes:")
        for c in b["configs"]:
            if "aggregate_tps" not in c:
                click.echo(f"  {c['server']:12s} spec {c['spec']:12s} failed every pass: {c['errors'][0]}")
                continue
            peer = peer_of(c, b["configs"])  # speculation on: llama-server's best n-gram mode of this run
            paired = paired_ratio(c, peer) if peer else None
            vs = (f"; {c['aggregate_tps'] / peer['aggregate_tps']:.2f}x llama-server {peer['spec']}"
                  + (f" (median per pass {paired:.2f}x)" if paired is not None else "")) if peer else ""
            same = (f"; greedy texts equal one-sequence: {c['texts_equal_one_sequence']}"
                    if "texts_equal_one_sequence" in c else
                    f"; seeded texts equal speculation off: {c['texts_equal_undrafted']}"
                    if "texts_equal_undrafted" in c else "")
            click.echo(f"  {c['server']:12s} spec {c['spec']:12s} {c['aggregate_tps']:6.1f} tok/s, TTFT p50 "
                       f"{c['ttft_p50_s']:.3f} s p95 {c['ttft_p95_s']:.3f} s{vs}{same}")
    if "interleaved" in r:
        iv = r["interleaved"]
        click.echo(f"interleaved: {iv['conversations']} conversations through {iv['parallel']} slots, second turns: "
                   + "; ".join(f"{label.replace('_', ' ')} TTFT p50 {iv[label]['ttft_s']['p50']:.3f} s p95 "
                               f"{iv[label]['ttft_s']['p95']:.3f} s (prefill p50 {iv[label]['prefill_s']['p50']:.3f} s)"
                               for label in ("cache", "no_cache"))
                   + f"; texts equal: {iv['texts_equal']}")
    if "turns" in r:
        tu = r["turns"]
        click.echo(f"second turn over {tu['conversations']} conversations: TTFT warm p50 "
                   f"{tu['warm_ttft_s']['p50']:.3f} s (prefill {tu['warm_prefill_s']['p50']:.3f} s) vs cold p50 "
                   f"{tu['cold_ttft_s']['p50']:.3f} s (prefill {tu['cold_prefill_s']['p50']:.3f} s)")
