"""Runtime figures for the foundation issue, measured side by side in one process.

    python scripts/bench_runtime.py MODEL.gguf DRAFT.safetensors [--prompts 8] [--tokens 128]

Interleaved prompt by prompt (so machine drift cancels), greedy, same threads, and the
product's own defaults (q8_0 KV cells, 32-row micro-batches) for every loop:
  raw      the bare low-level llama.cpp loop (RawGreedy) on hetero-spec's own context, as
           ``hetero-spec bench`` runs it (a second context differs in speed and, with other
           KV cells, in output: on F16 cells this script once reported 2/4 equal to raw)
  plain    hetero-spec --no-draft (same LlamaTarget, embeddings off)
  spec     hetero-spec with the draft at k = --k
Prints median tokens/s of each, the plain/raw ratio, the median orchestrator overhead per
round, the median draft time per drafted token, and output equality with raw.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from hetero_spec.config import DEFAULT_KV_TYPE, DRAFT_DTYPES, KV_TYPES


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--prompts", default=8, show_default=True)
@click.option("--tokens", default=128, show_default=True)
@click.option("--k", default=3, show_default=True)
@click.option("--dataset", default="mt_bench", show_default=True)
@click.option("--draft-dtype", type=click.Choice(DRAFT_DTYPES), default="auto", show_default=True)
@click.option("--threads", "-t", default=0, type=click.IntRange(0), help="threads (0 = all cores)")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default=DEFAULT_KV_TYPE, show_default=True)
def main(model: Path, draft: Path, prompts: int, tokens: int, k: int, dataset: str, draft_dtype: str, threads: int,
         kv_type: str) -> None:
    from hetero_spec.api import HeteroSpec
    from hetero_spec.bench.baselines import RawRun
    from hetero_spec.bench.prompts import load_dataset

    texts = load_dataset(dataset, prompts).prompts
    hs = HeteroSpec(model, draft, n_ctx=2048, threads=threads, draft_device="cpu", draft_dtype=draft_dtype,
                    kv_type=kv_type)
    raw = RawRun(hs)  # the bench's baseline: the plain loop on hetero-spec's own context and KV cells
    rows = []
    for text in texts:
        ids = hs.target.tokenize(hs.render([{"role": "user", "content": text}]), add_special=False,
                                 parse_special=True)
        base = raw.run(ids, tokens)
        ref, raw_s = base.tokens, base.wall_s
        res = {}
        for name, kk in (("plain", 0), ("spec", k)):
            hs.reset()
            t0 = time.perf_counter()
            out = hs.generate(ids, max_new_tokens=tokens, draft_len=kk)
            res[name] = (time.perf_counter() - t0, out)
        spec = res["spec"][1].stats
        rounds = spec.rounds
        rows.append(dict(
            raw_tps=len(ref) / raw_s,
            plain_tps=len(res["plain"][1].tokens) / res["plain"][0],
            spec_tps=len(res["spec"][1].tokens) / res["spec"][0],
            overhead_ms=statistics.median(r.overhead_s for r in rounds) * 1e3,
            draft_ms_per_token=statistics.median(r.draft_s / r.drafted for r in rounds if r.drafted) * 1e3,
            verify_ms=statistics.median(r.verify_s for r in rounds) * 1e3,
            mal=spec.mean_accepted_length,
            equal=res["plain"][1].tokens == ref and res["spec"][1].tokens == ref,
        ))
        click.echo(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "equal"}
    click.echo(f"median over {len(rows)} prompts ({tokens} new tokens, k={k}):")
    for key, v in med.items():
        click.echo(f"  {key:20s} {v:8.3f}")
    ratio = statistics.median(r["plain_tps"] / r["raw_tps"] for r in rows)
    click.echo(f"  plain/raw speed      {ratio:8.3f}")
    click.echo(f"  outputs equal to raw {sum(r['equal'] for r in rows)}/{len(rows)}")
    raw.close()
    hs.close()


if __name__ == "__main__":
    main()
