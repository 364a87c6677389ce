"""``hetero-spec bench project``: an earlier bench run on other machines' cost curves (no re-run, no model).

    hetero-spec bench project bench-out/bench.json [--curve this-machine --curve laptop-7b-q4_0] [--write]

Replays every prompt's recorded rounds (bench.json keeps them) against each curve, a shipped
name or a ``hetero-spec calibrate --out`` JSON, and prints the projected decode speedups beside
the measured ones.  They are projections, and the table says so.  ``--write`` stores them in
the bench.json and rewrites bench.md beside it.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import HeteroSpecError
from .projection import CURVES, THIS_RUN, load_curve, project_result, this_run_curve
from .report import bench_dict, markdown, projection_markdown
from .results import load_bench_json


@click.command("project")
@click.argument("bench_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--curve", "curves", multiple=True, default=tuple(CURVES), show_default=True,
              help="a shipped curve name, a calibration JSON, or this-run (the curve the bench timed "
                   "between its prompts, with --project this-run); repeatable")
@click.option("--write", is_flag=True, help="store the projections in BENCH_JSON and rewrite bench.md beside it")
def project(bench_json: Path, curves: tuple[str, ...], write: bool) -> None:
    """Replay a bench.json's recorded rounds on other cost curves: projected decode speedups beside measured."""
    result = load_bench_json(bench_json)
    try:
        loaded = dict((THIS_RUN, this_run_curve(result)) if c == THIS_RUN else load_curve(c) for c in curves)
    except HeteroSpecError as exc:
        raise click.ClickException(str(exc)) from None
    result.projections = project_result(result, loaded)
    if not result.projections:
        raise click.ClickException(f"{bench_json} holds no recorded rounds (run hetero-spec methods such as auto)")
    click.echo("\n".join(projection_markdown(result.projections)))
    if write:
        bench_json.write_text(json.dumps(bench_dict(result), indent=1))
        (bench_json.parent / "bench.md").write_text(markdown(result))
        click.echo(f"wrote {bench_json} and {bench_json.parent / 'bench.md'}", err=True)
