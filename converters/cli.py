"""Click commands of the converters package, registered in hetero_spec.cli.EXTRA_COMMANDS.

Heavy imports stay inside the commands so ``hetero-spec --help`` starts fast.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import click


def _type_choice() -> click.Choice:
    from hetero_spec.target.quantize import FTYPES

    return click.Choice(sorted(FTYPES), case_sensitive=False)


@click.command("quantize")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--type", "qtype", default="Q4_0", show_default=True, help="file type: Q4_0, Q8_0, Q4_K_M, ...")
@click.option("--token-embedding-type", help="tensor type of token_embd (e.g. Q4_0); default: llama.cpp's choice")
@click.option("--output-tensor-type", help="tensor type of the LM head (e.g. Q4_0); default: llama.cpp's choice")
@click.option("--pure", is_flag=True, help="every tensor gets --type (no higher-precision exceptions)")
@click.option("--threads", "-t", default=0, type=click.IntRange(0), help="0 = all cores")
def quantize(src, dst, qtype, token_embedding_type, output_tensor_type, pure, threads) -> None:
    """Quantize the GGUF IN to OUT with llama.cpp's quantizer (re-quantization allowed, with a warning)."""
    from hetero_spec.target.quantize import QuantizeOptions, quantize as run_quantize

    opts = QuantizeOptions(qtype, token_embedding_type, output_tensor_type, threads, pure)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        out = run_quantize(src, dst, opts)
    for w in caught:
        click.echo(f"warning: {w.message}", err=True)
    click.echo(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
