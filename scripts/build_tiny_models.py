"""Build (or list) the architecture matrix's tiny random-weight GGUFs: one per family and quantization.

Each family is a transformers config with random weights, converted by the vendored
``convert_hf_to_gguf.py`` of the pinned llama-cpp-python sdist and quantized by llama.cpp
(``hetero_spec/tiny_models.py`` says why and how).  Models are cached under
``~/.cache/hetero-spec/models/tiny/`` (``HETERO_SPEC_CACHE`` moves it), so tests and CI build them
once; this script builds them ahead of time, prints their paths, or rebuilds them.

\b
    python scripts/build_tiny_models.py                       # all families x Q4_0, Q8_0, Q4_K_M
    python scripts/build_tiny_models.py -f qwen3 -q Q4_K_M    # one file; prints its path
    python scripts/build_tiny_models.py --force               # rebuild (after changing a config)
    python scripts/build_tiny_models.py --list                # families, llama.cpp architectures, paths
"""
from __future__ import annotations

import sys
import time

import click

from hetero_spec.errors import HeteroSpecError
from hetero_spec.tiny_models import FAMILIES, QUANTS, build_all, tiny_models_dir


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__)
@click.option("--family", "-f", "families", multiple=True, type=click.Choice(list(FAMILIES)),
              help="build only these families (repeatable; default: all)")
@click.option("--quant", "-q", "quants", multiple=True, type=click.Choice(list(QUANTS), case_sensitive=False),
              help="build only these quantizations (repeatable; default: all)")
@click.option("--force", is_flag=True, help="rebuild even if the cached files exist")
@click.option("--list", "list_only", is_flag=True, help="print the families and the cache folder; build nothing")
def main(families: tuple[str, ...], quants: tuple[str, ...], force: bool, list_only: bool) -> None:
    if list_only:
        click.echo(f"cache: {tiny_models_dir()}")
        for f in FAMILIES.values():
            click.echo(f"{f.name:9s} {f.arch:9s} {f.model_class:22s} {f.users_run}")
        return
    t0 = time.perf_counter()
    try:
        built = build_all(families or None, tuple(q.upper() for q in quants) or QUANTS, force=force)
    except HeteroSpecError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    for paths in built.values():
        for path in paths.values():
            click.echo(path)
    click.echo(f"{sum(map(len, built.values()))} files in {time.perf_counter() - t0:.1f}s", err=True)


if __name__ == "__main__":
    main()
