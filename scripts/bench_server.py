"""What the HTTP server costs: tokens/s through ``hetero-spec serve`` against ``hetero-spec run``,
latency with concurrent clients, and the time to first token of a conversation's second turn.

    python scripts/bench_server.py "$(python scripts/default_model.py)" -t 2 --out bench-server.json

1. overhead   the same prompts through ``hetero-spec run --stats-json`` (a subprocess each) and through
              the server (a streaming request each), interleaved prompt by prompt with the order
              alternating.  Decode tokens/s: run's own ``tokens_per_s``; the server's as the client
              sees it, (tokens - 1) / (last byte - first text).  End to end: tokens / (request sent ->
              last byte) against run's tokens / (prefill + decode).  Greedy texts must match.
2. load       N clients at once, each sending R streaming requests back to back: p50/p95 of the
              queue wait (the server's ``hetero_spec.queue_s``) and of the time to first token
              (request sent -> first text, at the client).
3. turns      per mt_bench conversation: turn 1, then turn 2 (which reuses turn 1's cached prefix),
              another conversation in between, then the same turn 2 again (only the template's
              shared system prefix is reusable): time to first token, warm against cold.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import httpx

from hetero_spec.bench.prompts import shipped_text

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
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()  # keep draining

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_chat(http: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    """One streaming request, timed at the client: sent, first text, last byte."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
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
    n = usage["completion_tokens"]
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


def overhead(http, model, engine, prompts, max_tokens, repeats) -> dict:
    rows = []
    for i, prompt in enumerate([p for _ in range(repeats) for p in prompts]):
        msgs = [{"role": "user", "content": prompt}]
        if i % 2:
            srv = stream_chat(http, msgs, max_tokens)
            cli = run_cli(model, engine, prompt, max_tokens)
        else:
            cli = run_cli(model, engine, prompt, max_tokens)
            srv = stream_chat(http, msgs, max_tokens)
        rows.append({"tokens": srv["tokens"], "same_text": srv["text"] == cli["text"],
                     "run_decode_tps": cli["decode_tps"], "server_decode_tps": srv["decode_tps"],
                     "server_reported_tps": srv["server"].get("tokens_per_s", 0.0),
                     "run_e2e_tps": cli["e2e_tps"], "server_e2e_tps": srv["tokens"] / srv["wall_s"]})
    ratio = [r["server_decode_tps"] / r["run_decode_tps"] for r in rows if r["run_decode_tps"] > 0]
    e2e = [r["server_e2e_tps"] / r["run_e2e_tps"] for r in rows if r["run_e2e_tps"] > 0]
    return {"rows": rows, "median_decode_ratio": statistics.median(ratio), "median_e2e_ratio": statistics.median(e2e),
            "all_texts_equal": all(r["same_text"] for r in rows)}


def load(url, prompts, clients, per_client, max_tokens) -> dict:
    def one_client(c: int) -> list[dict]:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
            return [stream_chat(http, [{"role": "user", "content": prompts[(c + r) % len(prompts)]}], max_tokens)
                    for r in range(per_client)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one_client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    queue = [r["server"]["queue_s"] for r in results]
    ttft = [r["ttft_s"] for r in results]
    return {"clients": clients, "requests": len(results), "queue_wait_s": pct(queue), "ttft_s": pct(ttft),
            "aggregate_tps": sum(r["tokens"] for r in results) / wall}


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


def pct(values: list[float]) -> dict:
    qs = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else values * 19
    return {"p50": statistics.median(values), "p95": qs[18], "n": len(values)}


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--threads", "-t", default=1, show_default=True, type=click.IntRange(1))
@click.option("--ctx", default=4096, show_default=True)
@click.option("--n-prompts", default=8, show_default=True, help="mt_bench prompts for the overhead part")
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--repeats", default=2, show_default=True, help="passes over the overhead part's prompts")
@click.option("--clients", default=8, show_default=True)
@click.option("--per-client", default=3, show_default=True, help="requests each concurrent client sends")
@click.option("--load-tokens", default=32, show_default=True, help="max_tokens of the load part's requests")
@click.option("--conversations", default=6, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="write the figures as JSON")
def main(model, draft, threads, ctx, n_prompts, max_tokens, repeats, clients, per_client, load_tokens, conversations,
         out):
    rows = [json.loads(ln)["turns"] for ln in shipped_text("mt_bench").splitlines() if ln.strip()]
    prompts = [t[0] for t in rows]
    engine = [str(draft), "--draft-device", "cpu"] if draft else ["--no-draft"]
    engine += ["-t", str(threads), "--ctx", str(ctx)]
    with Server([str(model), *engine]) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as http:
        stream_chat(http, [{"role": "user", "content": "Hi"}], 4)  # warm-up
        result = {
            "model": model.name, "draft": draft.name if draft else None, "threads": threads,
            "overhead": overhead(http, model, engine, prompts[:n_prompts], max_tokens, repeats),
            "load": load(srv.url, prompts, clients, per_client, load_tokens),
            "turns": turns(http, [(t[0], t[1]) for t in rows if len(t) > 1][:conversations], max_tokens),
        }
    report(result)
    if out:
        out.write_text(json.dumps(result, indent=2))


def report(r: dict) -> None:
    o, lo, tu = r["overhead"], r["load"], r["turns"]
    click.echo(f"model {r['model']}, draft {r['draft']}, {r['threads']} thread(s)")
    click.echo(f"overhead over {len(o['rows'])} runs: server/run decode tokens/s median ratio "
               f"{o['median_decode_ratio']:.3f} (overhead {100 * (1 - o['median_decode_ratio']):+.1f}%), end to end "
               f"{o['median_e2e_ratio']:.3f}; greedy texts equal: {o['all_texts_equal']}")
    for row in o["rows"]:
        click.echo(f"  {row['tokens']:4d} tok  run {row['run_decode_tps']:6.1f}  server {row['server_decode_tps']:6.1f}"
                   f" (server-side {row['server_reported_tps']:6.1f})  e2e run {row['run_e2e_tps']:6.1f} server "
                   f"{row['server_e2e_tps']:6.1f}")
    click.echo(f"load: {lo['clients']} clients, {lo['requests']} requests: queue wait p50 "
               f"{lo['queue_wait_s']['p50']:.3f} s p95 {lo['queue_wait_s']['p95']:.3f} s; "
               f"TTFT p50 {lo['ttft_s']['p50']:.3f} s p95 {lo['ttft_s']['p95']:.3f} s; "
               f"aggregate {lo['aggregate_tps']:.1f} tok/s")
    click.echo(f"second turn over {tu['conversations']} conversations: TTFT warm p50 {tu['warm_ttft_s']['p50']:.3f} s "
               f"(prefill {tu['warm_prefill_s']['p50']:.3f} s) vs cold p50 {tu['cold_ttft_s']['p50']:.3f} s "
               f"(prefill {tu['cold_prefill_s']['p50']:.3f} s)")


if __name__ == "__main__":
    main()
