"""Make a cost-equivalent target: BASE plus zero-output decoder blocks, about N times the per-token cost.

    python scripts/make_cost_equivalent_target.py BASE.gguf OUT.gguf --scale 10

The output is bit-identical to BASE (checked here on a few prompts: last-row logits and
greedy tokens) while every token pays the weight traffic and compute of a model about
N times larger.  It is NOT a real larger model; the file's metadata says so and the
bench labels it.  See hetero_spec/bench/cost_equivalent.py for why this works.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from hetero_spec.bench.cost_equivalent import LABEL, greedy_identity, plan, write_cost_equivalent
from hetero_spec.cli_types import FiniteFloat
from hetero_spec.errors import HeteroSpecError

CHECK_PROMPTS = ["Name three primes.", "Write a haiku about autumn.", "What is the capital of France?"]


@click.command()
@click.argument("base", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--scale", required=True, type=FiniteFloat(1.0), help="per-token cost relative to BASE")
@click.option("--check-tokens", default=24, show_default=True, type=click.IntRange(0),
              help="greedy tokens compared per prompt (0 = skip the identity check)")
def main(base: Path, out: Path, scale: float, check_tokens: int) -> None:
    import gguf

    p = plan(gguf.GGUFReader(base), scale)
    click.echo(f"{base.name}: {p.base_blocks} blocks, {p.base_bytes / 2**20:.0f} MiB; adding {p.extra_blocks} "
               f"zero-output blocks -> about {p.out_bytes / 2**20:.0f} MiB", err=True)
    with tqdm(total=int(p.out_bytes), unit="B", unit_scale=True, desc="writing") as bar:
        write_cost_equivalent(base, out, scale, progress=bar.update)
    if check_tokens:
        rows = greedy_identity(base, out, CHECK_PROMPTS, max_new_tokens=check_tokens)
        for r in rows:
            click.echo(f"  {'identical' if r['logits_equal'] and r['tokens_equal'] else 'DIFFERENT'}: "
                       f"logits {r['logits_equal']}, {r['tokens']} greedy tokens {r['tokens_equal']}  "
                       f"({r['prompt']!r})", err=True)
        if not all(r["logits_equal"] and r["tokens_equal"] for r in rows):
            raise HeteroSpecError(f"{out} does not reproduce {base.name} exactly; do not use it")
    click.echo(f"wrote {out}: {LABEL}, scale {scale:g}")


if __name__ == "__main__":
    try:
        main(standalone_mode=False)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except HeteroSpecError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
