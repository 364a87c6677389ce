"""Why the server's model lives on its worker thread: the same decode, from the thread that first used the
model and from a second thread, with each thread's CPU time and voluntary context switches (Linux /proc).

    python scripts/check_cross_thread.py "$(python scripts/default_model.py)" -t 2

``same``: every decode on the main thread.  ``cross``: one decode on the main thread, then two on a second
thread, as the server did when the model was built (and calibrated) before its worker thread started.
llama.cpp's CPU backend runs each decode in an OpenMP parallel region, and libgomp keeps one thread team
per calling thread: the second thread gets its own team beside the first one's idle workers.
"""
from __future__ import annotations

import os
import threading
import time

import click

from hetero_spec.api import HeteroSpec

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def snapshot() -> dict[str, tuple[int, int]]:
    """{thread id: (CPU ticks, voluntary context switches)} of this process."""
    out = {}
    base = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(base):
        try:
            stat = open(f"{base}/{tid}/stat").read().rsplit(")", 1)[1].split()
            status = open(f"{base}/{tid}/status").read().splitlines()
        except OSError:
            continue
        vol = next(int(ln.split()[1]) for ln in status if ln.startswith("voluntary_ctxt_switches"))
        out[tid] = (int(stat[11]) + int(stat[12]), vol)
    return out


def decode(hs: HeteroSpec, label: str, max_tokens: int) -> None:
    before = snapshot()
    out = hs.chat(PROMPT, max_new_tokens=max_tokens)
    after = snapshot()
    n = len(out.tokens)
    busy = {tid: (after[tid][0] - before.get(tid, (0, 0))[0], after[tid][1] - before.get(tid, (0, 0))[1])
            for tid in after}
    busy = {tid: v for tid, v in busy.items() if v[0] > 5}
    per_thread = ", ".join(f"{ticks / os.sysconf('SC_CLK_TCK'):.1f} s CPU / {switches / n:.1f} switches per token"
                           for ticks, switches in busy.values())
    click.echo(f"{label}: {out.stats.tokens_per_s:.1f} tok/s; busy threads: {per_thread}; threads alive "
               f"{len(after)}")


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--threads", "-t", default=0, show_default=True, help="llama.cpp threads (0: every core)")
@click.option("--max-tokens", default=400, show_default=True)
def main(model, threads, max_tokens):
    for mode in ("same", "cross"):
        with HeteroSpec(model, n_ctx=1024, threads=threads) as hs:
            decode(hs, f"{mode}: main thread", max_tokens)
            if mode == "same":
                decode(hs, f"{mode}: main thread again", max_tokens)
                decode(hs, f"{mode}: main thread a third time", max_tokens)
            else:
                def second() -> None:
                    decode(hs, f"{mode}: second thread", max_tokens)
                    decode(hs, f"{mode}: second thread again", max_tokens)

                t = threading.Thread(target=second)
                t.start()
                t.join()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
