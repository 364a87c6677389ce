"""Benchmark the feature export: extraction vs llama.cpp's raw batched prefill, and regeneration 1 vs N sequences.

    python scripts/bench_export.py [MODEL] [--threads 1] [--prompts 8] [--new 64] [--n-seq 1,4,8,16]

Ratios are measured side by side in one run; repeat with --repeats for medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from converters.export_features import extract
from hetero_spec.chat_template import render_chat
from hetero_spec.default_model import default_model_path
from hetero_spec.target.batch_generate import BatchGenerator, GenerateOptions
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench"


def bench_prompts(name: str, n: int) -> list[str]:
    rows = [json.loads(x) for x in (BENCH / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    return [r["turns"][0] for r in rows[:n]]


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
        ratios, ext, raw = [], [], []
        for _ in range(a.repeats):
            t.set_embeddings(True)
            t0 = time.perf_counter(); extract(t, ids); e = len(ids) / (time.perf_counter() - t0)
            with LlamaTarget(model, TargetOptions(n_ctx=4096, n_batch=512, n_threads=a.threads,
                                                  embeddings=False)) as r:
                t0 = time.perf_counter(); r.prefill(ids); p = len(ids) / (time.perf_counter() - t0)
            ext.append(e); raw.append(p); ratios.append(e / p)
        print(f"{model.name} threads={t.n_threads}: export {statistics.median(ext):.0f} tok/s, raw prefill "
              f"(n_batch 512, logits off) {statistics.median(raw):.0f} tok/s, median ratio "
              f"{statistics.median(ratios):.2f}")
        prompts = []
        for i, q in enumerate(bench_prompts("mt_bench", a.prompts)):
            s = render_chat(t.chat_template, [{"role": "user", "content": q}], bos_token=t.bos_token,
                            eos_token=t.eos_token)
            prompts.append((i, t.tokenize(s, add_special=False)))
    speeds = {}
    for n in [int(x) for x in a.n_seq.split(",")]:
        with BatchGenerator(model, GenerateOptions(n_seq=n, max_new_tokens=a.new, seq_ctx=1024,
                                                   n_threads=a.threads)) as g:
            t0 = time.perf_counter()
            out = {k: a for k, a, _ in g.generate(prompts)}
            dt = time.perf_counter() - t0
        speeds[n] = sum(len(v) for v in out.values()) / dt
        print(f"regenerate n_seq={n}: {speeds[n]:.1f} generated tok/s (prompt prefill included), "
              f"{speeds[n] / speeds[min(speeds)]:.2f}x n_seq={min(speeds)}")


if __name__ == "__main__":
    main()
