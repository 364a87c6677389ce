"""Benchmark the feature export: extraction vs llama.cpp's raw batched prefill, and regeneration 1 vs N sequences.

    python scripts/bench_export.py [MODEL] [--threads 1] [--prompts 8] [--new 64] [--n-seq 1,4,8,16]

Ratios are measured side by side in one run; repeat with --repeats for medians.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from converters.export_features import extract
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.chat_template import render_chat
from hetero_spec.default_model import default_model_path
from hetero_spec.engine.answers import AnswerGenerator, GenerateOptions
from hetero_spec.target.layer_taps import LayerTapTarget
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--n-seq", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    model = a.model or default_model_path()
    texts = bench_prompts("mt_bench", 40) + bench_prompts("alpaca", 40)
    with LlamaTarget(model, TargetOptions(n_ctx=4096, n_threads=a.threads)) as t:
        ids = t.tokenize(" ".join(texts))[: a.tokens]
        # the exporter's path: the eval callback stops before the LM head; 512 (default) and 32 rows
        ways = {f"export n_batch={n}": LayerTapTarget(model, (), n_ctx=4096, n_batch=n, n_threads=a.threads,
                                                       skip_head=True) for n in (512, 32)}
        ways["export with head (top-k), n_batch=32"] = t
        speeds: dict[str, list[float]] = {k: [] for k in ways}
        raw: list[float] = []
        with LlamaTarget(model, TargetOptions(n_ctx=4096, n_batch=512, n_threads=a.threads, embeddings=False)) as r:
            for _ in range(a.repeats):  # interleaved, so drift hits every way alike
                r.reset()
                t0 = time.perf_counter(); r.prefill(ids); p = len(ids) / (time.perf_counter() - t0)
                raw.append(p)
                for name, way in ways.items():
                    t0 = time.perf_counter()
                    way.run(ids) if isinstance(way, LayerTapTarget) else (way.reset(), extract(way, ids))
                    speeds[name].append(len(ids) / (time.perf_counter() - t0) / p)
        for way in ways.values():
            if isinstance(way, LayerTapTarget):
                way.close()
        print(f"{model.name} threads={t.n_threads}: raw prefill (n_batch 512, logits off) "
              f"{statistics.median(raw):.0f} tok/s")
        for name, ratios in speeds.items():
            print(f"  {name}: median {statistics.median(ratios):.2f}x raw prefill")
        prompts = []
        for i, q in enumerate(bench_prompts("mt_bench", a.prompts)):
            s = render_chat(t.chat_template, [{"role": "user", "content": q}], bos_token=t.bos_token,
                            eos_token=t.eos_token)
            prompts.append((i, t.tokenize(s, add_special=False)))
    speeds = {}
    for n in [int(x) for x in a.n_seq.split(",")]:
        with AnswerGenerator(model, GenerateOptions(n_seq=n, max_new_tokens=a.new, seq_ctx=1024,
                                                   n_threads=a.threads)) as g:
            t0 = time.perf_counter()
            out = {k: a for k, a, _ in g.generate(prompts)}
            dt = time.perf_counter() - t0
        speeds[n] = sum(len(v) for v in out.values()) / dt
        print(f"regenerate n_seq={n}: {speeds[n]:.1f} generated tok/s (prompt prefill included), "
              f"{speeds[n] / speeds[min(speeds)]:.2f}x n_seq={min(speeds)}")


if __name__ == "__main__":
    main()
