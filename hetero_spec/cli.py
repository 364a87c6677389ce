"""Command line: thin click commands that parse options, build a config and call the API."""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

import click

from . import atomic_file
from .cli_types import FiniteFloat
from .config import (DEFAULT_CACHE_RAM_MIB, DEFAULT_KV_TYPE, DRAFT_DTYPES, KV_TYPES, MAX_THREADS, MIN_CTX,
                     DenoiseConfig)
from .errors import HeteroSpecError

DEVICE_HELP = "where the draft runs: auto (CUDA when torch sees it), cpu, cuda or cuda:N"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hetero-spec")
def cli() -> None:
    """Speculative decoding: a GGUF target on the CPU, a small PyTorch draft beside it."""


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("draft", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-p", "--prompt", help="prompt text; omit for an interactive session")
@click.option("--chat/--raw", default=True, show_default=True, help="apply the GGUF's chat template")
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--draft-len", "-k", default="auto", show_default=True,
              help="draft tokens per round (0..32), or auto: sized each round from the cost curve and acceptance")
@click.option("--tree", is_flag=True, help="draft an EAGLE-2-style tree instead of a chain")
@click.option("--tree-tokens", default=12, show_default=True, type=click.IntRange(1, 31), help="drafted nodes per tree")
@click.option("--tree-depth", default=6, show_default=True, type=click.IntRange(1, 31), help="tree depth (the maximum with auto)")
@click.option("--tree-top-k", default=2, show_default=True, type=click.IntRange(1, 8), help="children per expansion")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0), help="0 = greedy")
@click.option("--top-k", default=40, show_default=True, type=int, help="sampling: keep the k most likely (<= 0: off)")
@click.option("--top-p", default=0.95, show_default=True, type=FiniteFloat(), help="sampling: nucleus mass (1: off)")
@click.option("--min-p", default=0.05, show_default=True, type=FiniteFloat(), help="sampling: min probability relative to the top")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(-1),
              help="sampling seed (reproducible runs); -1: a fresh one each run, as llama.cpp")
@click.option("--draft-p-min", type=FiniteFloat(), help="stop drafting when the draft's top probability falls below (default: 0.1 with auto)")
@click.option("--no-draft", is_flag=True, help="plain decoding through the same code, for comparison")
@click.option("--lookup/--no-lookup", default=True, show_default=True,
              help="with --draft-len auto, also draft by copying repeated text where that pays")
@click.option("--suffix/--no-suffix", default=None,
              help="with --draft-len auto, copy from a suffix structure over the prompt, the output and earlier "
                   "outputs; --no-suffix: prompt lookup (repeated n-grams) instead  [default: as --lookup]")
@click.option("--suffix-cache", type=click.Path(dir_okay=False, path_type=Path),
              help="load earlier outputs for the suffix structure from FILE if it exists, save them there at the end")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="target threads (0 = physical cores)")
@click.option("--ctx", default=4096, show_default=True, type=click.IntRange(MIN_CTX), help="context size in tokens")
@click.option("--draft-device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--draft-dtype", type=click.Choice(DRAFT_DTYPES), default="auto", show_default=True,
              help="auto: int8 weights on a CPU where int8 is measured accurate, else the fastest float")
@click.option("--denoise", default=0.0, show_default=True, type=FiniteFloat(), help="drop draft keys whose importance gate is below this")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default=DEFAULT_KV_TYPE, show_default=True,
              help="target KV cells: q8_0 keeps greedy output bit-identical to plain decoding at any length; "
                   "f16 (llama.cpp's default) differs past 256 cells with 2+ threads")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--stats-json", type=click.Path(dir_okay=False, path_type=Path), help="write the run's stats here")
@click.option("--exact", is_flag=True,
              help="where MODEL's verification rows are bit-exact to plain decoding only in short batches (checked "
                   "once per file and CPU), run its nearest requantization that is exact up to 32 rows (made once, "
                   "cached) instead of capping the drafts")
@click.option("--verbose", "-v", is_flag=True, help="say which llama.cpp kernels and draft device run, on stderr")
def run(model, draft, prompt, chat, max_tokens, draft_len, tree, tree_tokens, tree_depth, tree_top_k, temperature,
        top_k, top_p, min_p, seed, draft_p_min, no_draft, lookup, suffix, suffix_cache, threads, ctx, draft_device,
        draft_dtype, denoise, kv_type, stop, stats_json, exact, verbose) -> None:
    """Generate with MODEL (GGUF) verified on the CPU and DRAFT (safetensors) proposing tokens; without a
    DRAFT, auto drafts from the text itself (the suffix structure or prompt lookup)."""
    import warnings

    from .api import ExactnessWarning, HeteroSpec
    from .config import SamplingConfig, TreeSpec, parse_draft_len

    options = dict(max_new_tokens=max_tokens, draft_len=0 if no_draft else parse_draft_len(draft_len), stop=stop,
                   tree=TreeSpec(tree_tokens, tree_depth, tree_top_k) if tree else None, draft_p_min=draft_p_min,
                   sampling=SamplingConfig(temperature, top_k, top_p, min_p, _fresh_seed() if seed < 0 else seed),
                   lookup=lookup, suffix=suffix)

    def one_line(message, category, filename, lineno, file=None, line=None, show=warnings.showwarning) -> None:
        """The exactness notices as one line each (Python's format adds the calling source line)."""
        if issubclass(category, ExactnessWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.showwarning = one_line
        with HeteroSpec(model, None if no_draft else draft, n_ctx=ctx, threads=threads, draft_device=draft_device,
                        draft_dtype=draft_dtype, denoise=DenoiseConfig(threshold=denoise), kv_type=kv_type,
                        exact=exact) as hs:
            if verbose and hs.invariance is not None:
                click.echo(f"exactness: {hs.invariance.describe()}; verifications capped at {hs.exact_rows} rows",
                           err=True)
            if suffix_cache is not None and suffix_cache.is_file():
                try:
                    hs.suffix_cache.load(suffix_cache)
                except ValueError as exc:
                    raise HeteroSpecError(str(exc)) from None
            try:
                _run_turns(hs, prompt, chat, options, stats_json, verbose)
            finally:
                if suffix_cache is not None:
                    hs.suffix_cache.save(suffix_cache)


def _fresh_seed() -> int:
    """``--seed -1``: a new seed each run, said on stderr so that a run worth keeping can be repeated."""
    seed = secrets.randbits(32)
    click.echo(f"seed {seed}", err=True)
    return seed


def _run_turns(hs, prompt: str | None, chat: bool, options: dict, stats_json: Path | None, verbose: bool) -> None:
    """One turn with ``prompt``, else an interactive session."""
    if verbose:
        click.echo(f"kernels: {hs.target.kernels}", err=True)
        if hs.draft is not None:
            click.echo(f"draft: {hs.draft.device} {hs.draft.weights}, {hs.draft.step_kind} steps", err=True)
    if prompt is not None:
        _one_turn(hs, prompt, chat, options, stats_json, history=None)
        return
    history: list[dict[str, str]] = []
    click.echo("interactive session: empty line or Ctrl-D to quit", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        _one_turn(hs, line, chat, options, stats_json, history=history)


def _one_turn(hs, prompt: str, chat: bool, options: dict, stats_json: Path | None, history: list | None) -> None:
    if chat:
        messages = (history or []) + [{"role": "user", "content": prompt}]
        stream = hs.chat(messages, stream=True, **options)
    else:
        stream = hs.generate(prompt, stream=True, **options)
    interrupted = False
    try:
        for piece in stream:
            click.echo(piece, nl=False)
    except KeyboardInterrupt:
        interrupted = True
        stream.close()
        stream.stats.stop_reason = "interrupted"
    click.echo()
    if history is not None and chat:
        history += [messages[-1], {"role": "assistant", "content": hs.target.detokenize(
            [t for t in stream.tokens if not hs.target.is_eog(t)])}]
    click.echo(f"[{stream.stats.summary()}]", err=True)
    if stats_json is not None:
        atomic_file.write_text(stats_json, json.dumps(stream.stats.to_dict(), indent=2))
    if interrupted:
        sys.exit(130)


AUTO_PARALLEL = 4  # llama-server's default slots (-np auto)


def serve_slots(parallel: int, tree: bool) -> int:
    """The slots ``serve`` runs: ``--parallel``, or with auto (0) llama-server's 4, draft model or not, since the
    batched engine drafts for every slot (one client measured no slower than ``run``, docs/server.md); a
    ``--tree`` asks for the one-sequence path (trees draft for one sequence at a time), so 1."""
    return parallel or (1 if tree else AUTO_PARALLEL)


def _parse_parallel(ctx, param, value) -> int:
    """``--parallel``: ``auto`` (0 here, settled once the draft is known) or 1..32."""
    if value == "auto":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected auto or a number of slots, not {value!r}") from None
    if not 1 <= n <= 32:
        raise click.BadParameter(f"slots must be in 1..32, not {n}")
    return n


@cli.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--no-draft", is_flag=True, help="plain decoding (also the default without a DRAFT)")
@click.option("--draft-len", "-k", default="auto", show_default=True, help="draft tokens per round (0..32), or auto")
@click.option("--tree", is_flag=True, help="draft an EAGLE-2-style tree instead of a chain")
@click.option("--tree-tokens", default=12, show_default=True, type=click.IntRange(1, 31),
              help="drafted nodes per tree")
@click.option("--tree-depth", default=6, show_default=True, type=click.IntRange(1, 31), help="tree depth")
@click.option("--tree-top-k", default=2, show_default=True, type=click.IntRange(1, 8), help="children per expansion")
@click.option("--draft-p-min", type=FiniteFloat(), help="stop drafting when the draft's top probability falls below")
@click.option("--lookup/--no-lookup", default=True, show_default=True,
              help="with --draft-len auto, also draft by copying repeated text where that pays")
@click.option("--suffix/--no-suffix", default=None,
              help="with one slot (--parallel 1, --tree): copy from the suffix structure over prompts and earlier "
                   "answers; --no-suffix: prompt lookup instead  [default: as --lookup]")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="target threads (0 = physical cores)")
@click.option("--ctx", default=4096, show_default=True, type=click.IntRange(MIN_CTX), help="context size in tokens")
@click.option("--draft-device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--draft-dtype", type=click.Choice(DRAFT_DTYPES), default="auto", show_default=True,
              help="auto: int8 weights on a CPU where int8 is measured accurate, else the fastest float")
@click.option("--denoise", default=0.0, show_default=True, type=FiniteFloat(),
              help="drop draft keys whose importance gate is below this")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default=DEFAULT_KV_TYPE, show_default=True,
              help="target KV cells")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind; anything but loopback warns")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port")
@click.option("--api-key", envvar="HETERO_SPEC_API_KEY",
              help="require 'Authorization: Bearer KEY' (env HETERO_SPEC_API_KEY)")
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(0),
              help="waiting requests; more get a 429")
@click.option("--queue-timeout", default=300.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="seconds a request may wait for the model before a 503")
@click.option("--max-body", default=1 << 20, show_default=True, type=click.IntRange(1024),
              help="largest request body in bytes (413)")
@click.option("--model-alias", help="model id in /v1/models and requests (default: the GGUF file name, no .gguf)")
@click.option("--parallel", default="auto", show_default=True, callback=_parse_parallel,
              help="slots: requests decoded together in one llama_decode per step, --ctx cells each (> 1: the "
                   "batched engine: copy drafts, and a DRAFT's chains up to --draft-len deep, priced on the batch; "
                   "no trees); auto: 4 (llama-server's default), 1 with --tree")
@click.option("--cache-ram", default=DEFAULT_CACHE_RAM_MIB, show_default=True, type=click.IntRange(0), metavar="MIB",
              help="with slots: host memory for the cells of past prompts, put back when a later prompt starts alike "
                   "(a conversation's next turn, a shared preamble; 0: off)")
def serve(model, draft, no_draft, draft_len, tree, tree_tokens, tree_depth, tree_top_k, draft_p_min, lookup, suffix,
          threads, ctx, draft_device, draft_dtype, denoise, kv_type, host, port, api_key, max_queue, queue_timeout, max_body,
          model_alias, parallel, cache_ram) -> None:
    """Serve MODEL (and DRAFT) over an OpenAI-compatible HTTP API (needs the [server] extra)."""
    from .config import TreeSpec, parse_draft_len
    from .server import EngineConfig, ServerConfig
    from .server import serve as run_server

    if api_key is None and "HETERO_SPEC_API_KEY" in os.environ:  # click reads an empty variable as unset
        api_key = os.environ["HETERO_SPEC_API_KEY"]
    if api_key is not None and not api_key.strip():  # `--api-key "$KEY"` with KEY unset: not an open server
        raise HeteroSpecError("--api-key (or HETERO_SPEC_API_KEY) is empty, an unset variable?: give the key, or "
                              "leave both out to serve without one")

    engine = EngineConfig(model=model, draft=None if no_draft else draft, n_ctx=ctx, threads=threads,
                          draft_device=draft_device, draft_dtype=draft_dtype, denoise=DenoiseConfig(threshold=denoise),
                          kv_type=kv_type, draft_len=0 if no_draft else parse_draft_len(draft_len),
                          tree=TreeSpec(tree_tokens, tree_depth, tree_top_k) if tree else None,
                          draft_p_min=draft_p_min, lookup=lookup, suffix=suffix,
                          parallel=serve_slots(parallel, tree), cache_ram_mib=cache_ram)
    server = ServerConfig(model_id=model_alias or model.name.removesuffix(".gguf"), host=host, port=port,
                          api_key=api_key, max_queue=max_queue, queue_timeout=queue_timeout,
                          max_body_bytes=max_body)
    run_server(engine, server)


@cli.command("new-draft")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["darter", "dovetail", "eagle", "eagle3"]), default="darter",
              show_default=True)
@click.option("--taps", default="", help="target blocks whose input the draft reads (EAGLE-3 fusion), e.g. 2,15,27")
@click.option("--blocks", type=click.IntRange(1), help="decoder blocks (default from the preset)")
@click.option("--reduced-vocab", default=8192, show_default=True, type=click.IntRange(0),
              help="head rows kept (0 = full vocabulary); untrained drafts keep the lowest ids")
@click.option("--seed", default=0, show_default=True)
def new_draft(model, out, preset, taps, blocks, reduced_vocab, seed) -> None:
    """Write an untrained (randomly initialised) draft for MODEL; training replaces it with a useful one."""
    from .draft_factory import create_draft

    try:
        tap_list = tuple(int(x) for x in taps.split(",")) if taps else ()
    except ValueError:
        raise click.BadParameter(f"comma-separated block indices, not {taps!r}", param_hint="--taps") from None
    path = create_draft(model, out, preset=preset, n_blocks=blocks, reduced_vocab=reduced_vocab, seed=seed,
                        taps=tap_list)
    click.echo(f"wrote {path}")


# Commands that live with their own package, as "module:attribute" of a click command.
# Imported when the CLI starts, so those modules keep their heavy imports inside the command.
EXTRA_COMMANDS: list[str] = [
    "converters.cli:quantize",
    "converters.cli:export_features",
    "converters.cli:merge_features",
    "converters.cli:generate_corpus",
    "converters.cli:make_prompts",
    "converters.cli:export_draft",
    "converters.cli:import_draft",
    "hetero_spec.train_cli:train",
    "hetero_spec.train_cli:analyze_attention",
    "hetero_spec.bench.cli:bench",
    "hetero_spec.bench.cli:calibrate",
    "hetero_spec.make_draft:make_draft",
]


def _register_extra_commands() -> None:
    import importlib

    for entry in EXTRA_COMMANDS:
        module, attr = entry.split(":")
        cli.add_command(getattr(importlib.import_module(module), attr))


_register_extra_commands()


def main() -> None:
    """Console entry point: user mistakes become one line on stderr and a non-zero exit."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except HeteroSpecError as exc:  # ConfigError included
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
