"""What EAGLE-3 taps cost the target per decode: the same context with block-input extraction on and off.

One LlamaTarget (two contexts of one model differ by up to 8% per token for their whole lifetime, see
docs/bench.md), taps switched with llama.cpp's ``llama_set_embeddings_layer_inp`` between interleaved
timings of 1- and k+1-row decodes at a fixed cache length; medians of per-pair ratios.

    python scripts/bench_taps.py "$(python scripts/default_model.py)" --taps 2,15,27 -t 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from hetero_spec.target import _ffi
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


def timed(t: LlamaTarget, tokens: list[int], n_keep: int) -> float:
    t0 = time.perf_counter()
    t.verify(tokens)
    dt = time.perf_counter() - t0
    t.rollback(n_keep)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--taps", default="2,15,27")
    ap.add_argument("--rows", default="1,2,4,5")
    ap.add_argument("--prefix", type=int, default=300, help="cached tokens before the timed decodes")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    taps = tuple(int(x) for x in a.taps.split(","))
    with LlamaTarget(a.model, TargetOptions(n_ctx=2048, n_threads=a.threads, taps=taps)) as t:
        api = _ffi.layer_inputs()
        prefix = [(1000 + 7 * i) % 40000 for i in range(a.prefix)]
        t.prefill(prefix)
        for n in (int(x) for x in a.rows.split(",")):
            rows = prefix[:n]
            ratios, on_ms = [], []
            for i in range(a.pairs):
                pair = {}
                for state in ((True, False) if i % 2 else (False, True)):
                    for tap in taps:
                        api.set(t._ctx.ptr, tap, state)
                    t._taps = api if state else None  # off: read the final hidden state instead (a disabled tap aborts)
                    pair[state] = timed(t, rows, a.prefix)
                ratios.append(pair[True] / pair[False])
                on_ms.append(pair[True] * 1e3)
            print(f"{n} rows: taps on / off = {statistics.median(ratios):.3f} (median of {a.pairs} pairs), "
                  f"t(taps on) {statistics.median(on_ms):.2f} ms")
        for tap in taps:
            api.set(t._ctx.ptr, tap, True)
        t._taps = api


if __name__ == "__main__":
    main()
