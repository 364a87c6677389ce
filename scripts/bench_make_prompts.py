"""What sampling the target's own requests (``make-prompts``) costs: one request at a time against several.

    python scripts/bench_make_prompts.py "$(python scripts/default_model.py)" --n 130 --seed 1 -t 2 \
        --system "You are an expert Python programmer who writes and explains code." --passes 3

Each pass runs ``make-prompts`` once per ``--n-seq`` value into a fresh file, the order rotated pass by pass so
that a drifting machine slows them alike; figures are medians over the passes.  Every run must write the same
file (a request's draw does not depend on what shares its decodes): the JSON says whether they all did.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

from converters.self_prompts import PromptConfig, make_prompts
from hetero_spec.bench.command import script_command
from hetero_spec.bench.server_load import cpu_name


def one(cfg: PromptConfig) -> dict:
    t0 = time.perf_counter()
    state = make_prompts(cfg, progress=False)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "attempts": state["attempts"], "kept": state["kept"],
            "sha256": hashlib.sha256(Path(cfg.out).read_bytes()).hexdigest()}


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--n", default=130, show_default=True, type=click.IntRange(1), help="prompts to keep")
@click.option("--seed", default=1, show_default=True)
@click.option("--system", default="", help="the system message that steers the topic")
@click.option("--template", default="gguf", show_default=True, type=click.Choice(["gguf", "plain"]))
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--n-seq", "n_seqs", default="1,16", show_default=True, help="comma-separated values to compare")
@click.option("--threads", "-t", default=0, show_default=True, help="0: every core")
@click.option("--passes", default=3, show_default=True, type=click.IntRange(1))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="write the figures here as JSON")
def main(model, n, seed, system, template, max_tokens, n_seqs, threads, passes, out):
    values = [int(v) for v in n_seqs.split(",")]
    runs: dict[int, list[dict]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(passes):
            for v in values[p % len(values):] + values[: p % len(values)]:
                path = Path(tmp) / f"{p}-{v}.jsonl"
                runs[v].append(one(PromptConfig(model=model, out=path, n=n, seed=seed, system=system, template=template,
                                                max_tokens=max_tokens, threads=threads, n_seq=v)))
                r = runs[v][-1]
                click.echo(f"pass {p + 1}, --n-seq {v}: {r['wall_s']:.1f} s, {r['kept']} kept of {r['attempts']}")
    base = statistics.median(r["wall_s"] for r in runs[values[0]])
    rows = []
    for v in values:
        wall = statistics.median(r["wall_s"] for r in runs[v])
        rs = runs[v][0]
        rows.append({"n_seq": v, "wall_s": wall, "attempts": rs["attempts"], "kept": rs["kept"],
                     "samples_per_s": rs["attempts"] / wall, "speed_vs_first": base / wall, "passes": runs[v]})
        click.echo(f"--n-seq {v}: {wall:.1f} s median, {rs['attempts'] / wall:.2f} samples/s, "
                   f"{base / wall:.2f}x --n-seq {values[0]}")
    identical = len({r["sha256"] for rs in runs.values() for r in rs}) == 1
    click.echo(f"every run wrote the same file: {identical}")
    if out:
        command = script_command(sys.argv)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": command, "cpu": cpu_name(), "model": model.name, "threads": threads,
                                   "n": n, "system": system, "template": template, "max_tokens": max_tokens,
                                   "identical": identical, "rows": rows}, indent=1))
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
