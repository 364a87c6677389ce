"""Export distillation features from the GGUF target itself (llama.cpp, embeddings on).

WHY from the GGUF: the draft must learn the very quantized target that will verify it, so
hidden states come from the same llama.cpp runtime (``LlamaTarget``) with the same 32-row
micro-batches, not from an fp16 checkpoint.

Work is cut into chunks of conversations at fixed positions of the selection; shards are
written only at chunk boundaries and the manifest records the next chunk, so a restart
resumes exactly where the last shard ended and produces the same sequences in the same
order as an uninterrupted run.  Ctrl-C flushes the chunks already finished into a shard.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero_spec.errors import HeteroSpecError
from hetero_spec.features import (FeatureSequence, Manifest, ShardInfo, read_manifest, shard_name, write_manifest,
                                  write_shard)

from .datasets import (ChatRenderer, Conversation, LoadedSource, assistant_mask, file_sha256, load_source,
                       resolve_source, select)

DTYPES = {"float16": np.float16, "float32": np.float32}


class ExportError(HeteroSpecError):
    pass


@dataclass(frozen=True)
class ExportConfig:
    model: Path
    out: Path
    source: str | None = None  # path, or None / "sharegpt" for the packaged ShareGPT file
    limit: int | None = None
    offset: int = 0
    seed: int | None = None
    shard: tuple[int, int] = (0, 1)  # process i of N
    regenerate: bool = False
    temperature: float = 0.0
    max_new_tokens: int = 256
    n_seq: int = 8  # sequences generated together with --regenerate
    dtype: str = "float16"
    max_len: int = 2048
    topk: int = 0
    layers: tuple[int, ...] = ()
    threads: int = 0
    shard_mb: int = 256
    chunk: int = 32  # conversations per unit of work (resume granularity)
    # Rows per llama.cpp micro-batch.  Over q8_0 KV cells (the default) 512 gives the runtime's
    # 32-row features bit for bit (tested); over F16 cells flash attention tiles large batches
    # differently, about 3% RMS off.
    prefill_batch: int = 512
    template: str = "gguf"  # "gguf" (the model's own) or "plain" (datasets.TEMPLATES)

    def content_options(self) -> dict:
        """What decides the dataset's content; a resumed run must match it exactly."""
        return dict(regenerate=self.regenerate, temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                    dtype=self.dtype, max_len=self.max_len, topk=self.topk, layers=list(self.layers),
                    chunk=self.chunk, seed=self.seed if self.temperature > 0 else None,
                    # only when not the default, so folders exported before the option still resume
                    **({"template": self.template} if self.template != "gguf" else {}))


@dataclass
class _Progress:
    next_index: int = 0  # position in the selection of the first conversation not yet in a shard
    done: bool = False
    sequences: list[FeatureSequence] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    tokens: int = 0


def export_features(cfg: ExportConfig, hf_model: Path | None = None) -> Manifest:
    """Run (or resume) an export into ``cfg.out``; returns the final manifest.

    ``hf_model``: compute hidden states with transformers from this checkpoint (see hf_export.py).
    """
    from tqdm import tqdm

    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    if cfg.dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}")
    src = load_source(resolve_source(cfg.source))
    items = select(src.conversations, limit=cfg.limit, offset=cfg.offset, seed=cfg.seed, shard=cfg.shard)
    if not items:
        raise ExportError("the selection is empty (check --limit/--offset/--shard)")
    with LlamaTarget(cfg.model, TargetOptions(n_ctx=cfg.max_len, n_batch=min(cfg.prefill_batch, cfg.max_len),
                                              n_threads=cfg.threads, embeddings=True)) as target:
        extractor = f"transformers:{hf_model.resolve()}" if hf_model is not None else "llama.cpp"
        renderer = ChatRenderer.for_target(target, cfg.template)  # refuses a model without a template early
        manifest = _open_manifest(cfg, target, src, extractor, renderer.template)
        prog = _Progress(next_index=manifest.options["progress"]["next_index"], done=manifest.options["progress"]["done"])
        if prog.done:
            print(f"{cfg.out}: already complete ({manifest.n_sequences} sequences); nothing to do")
            return manifest
        _check_disk(cfg, target, items[prog.next_index:])
        gen = taps = bar = None
        try:
            gen = _open_generator(cfg, hf_model) if cfg.regenerate else None
            if hf_model is not None:
                from .hf_export import HFExtractor

                taps = HFExtractor(hf_model, cfg.layers, n_embd=target.n_embd, n_vocab=target.n_vocab,
                                   threads=cfg.threads)
            elif cfg.layers or not cfg.topk:
                taps = _open_taps(cfg)
            bar = tqdm(total=len(items), initial=prog.next_index, unit="conv", desc="export", dynamic_ncols=True)
            t0 = time.perf_counter()
            for start in range(prog.next_index, len(items), cfg.chunk):
                chunk = items[start : start + cfg.chunk]
                skipped: Counter = Counter()
                done = [_features(target, ids, mask, cfg, taps, hidden)
                        for ids, mask, hidden in _encode_chunk(chunk, renderer, gen, cfg, skipped)]
                # only whole chunks enter the buffer, so an interrupted chunk is redone on resume
                prog.sequences += done
                prog.skipped += skipped
                prog.tokens += sum(len(x) for x in done)
                prog.next_index = start + len(chunk)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{prog.tokens / (time.perf_counter() - t0):.0f}", refresh=False)
                if _buffer_bytes(prog.sequences) >= cfg.shard_mb * 2**20:
                    _flush(cfg, manifest, prog)
            prog.done = True
            _flush(cfg, manifest, prog)
        except KeyboardInterrupt:
            _flush(cfg, manifest, prog)  # whole chunks only: the next run resumes after them
            raise
        finally:
            for owner in (bar, gen, taps):
                if owner is not None:
                    owner.close()
    return manifest


# ---------------------------------------------------------------- manifest and resume
def _open_manifest(cfg: ExportConfig, target, src: LoadedSource, extractor: str, template: str) -> Manifest:
    selection = dict(limit=cfg.limit, offset=cfg.offset, seed=cfg.seed, shard=f"{cfg.shard[0]}/{cfg.shard[1]}")
    # problems of the file itself are counted once here; per-conversation skips go to manifest.skipped
    source = dict(path=str(src.path), sha256=src.sha256, format=src.format, selection=selection,
                  n_conversations=len(src.conversations), skipped_in_file=dict(sorted(src.skipped.items())))
    options = dict(cfg.content_options(), model=dict(file=cfg.model.name, sha256=file_sha256(cfg.model)),
                   extractor=extractor, n_batch=cfg.prefill_batch)
    cfg.out.mkdir(parents=True, exist_ok=True)
    if (cfg.out / "manifest.json").exists():
        old = read_manifest(cfg.out)
        bad = old.fingerprint.mismatches(target.fingerprint)
        if bad:
            raise ExportError(f"{cfg.out} holds features of another target ({'; '.join(bad)}); use a new folder")
        old_opts = {k: v for k, v in old.options.items() if k != "progress"}
        if old_opts != options or old.source != source:
            diff = sorted(k for k in set(old_opts) | set(options) if old_opts.get(k) != options.get(k))
            diff += ["source"] if old.source != source else []
            raise ExportError(f"{cfg.out} was exported with different settings ({', '.join(diff)}); "
                              "use a new folder or the same options")
        return old
    options["progress"] = dict(next_index=0, done=False)
    m = Manifest(fingerprint=target.fingerprint, dtype=cfg.dtype, template=template, source=source,
                 options=options, skipped={})
    write_manifest(cfg.out, m)
    return m


def _flush(cfg: ExportConfig, manifest: Manifest, prog: _Progress) -> None:
    """Write buffered sequences as the next shard, then record the progress (shard first, manifest second)."""
    if prog.sequences:
        from safetensors import SafetensorError  # what save_file raises for an I/O error, a full disk included

        path = cfg.out / shard_name(len(manifest.shards))
        try:
            info = write_shard(path, prog.sequences, metadata={"first_index": str(prog.next_index)})
        except (OSError, SafetensorError) as exc:  # write_shard has removed its temporary
            why = getattr(exc, "strerror", None) or str(exc).split(" at path ")[0]
            raise ExportError(f"could not write {path.name} ({why}); completed shards are valid, "
                              "free some space and rerun the same command to resume") from None
        manifest.shards.append(info)
        prog.sequences = []
    for k, v in prog.skipped.items():
        manifest.skipped[k] = manifest.skipped.get(k, 0) + v
    prog.skipped = Counter()
    manifest.options["progress"] = dict(next_index=prog.next_index, done=prog.done)
    write_manifest(cfg.out, manifest)


def _buffer_bytes(seqs: list[FeatureSequence]) -> int:
    return sum(s.hidden.nbytes + s.input_ids.nbytes + s.loss_mask.nbytes + sum(v.nbytes for v in s.extras.values())
               for s in seqs)


def _check_disk(cfg: ExportConfig, target, items: list[Conversation]) -> None:
    """Rough upper estimate before starting: characters/3 tokens (capped by max_len) times bytes per token."""
    per_token = target.n_embd * np.dtype(DTYPES[cfg.dtype]).itemsize * (1 + len(cfg.layers)) + 5 + cfg.topk * 6
    tokens = 0
    for c in items:
        if cfg.regenerate:
            prompt = sum(len(m["content"]) for m in _first_prompt(c.messages) or [])
            tokens += min(cfg.max_len, prompt // 3 + cfg.max_new_tokens)
        else:
            tokens += min(cfg.max_len, sum(len(m["content"]) for m in c.messages) // 3)
    need = tokens * per_token
    free = shutil.disk_usage(cfg.out).free
    print(f"estimate: {len(items)} conversations, at most ~{tokens / 1e6:.1f}M tokens, ~{need / 2**30:.2f} GiB "
          f"(free: {free / 2**30:.1f} GiB)")
    if need > free:
        raise ExportError(f"not enough disk space in {cfg.out}: need about {need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free (use --limit)")


# ---------------------------------------------------------------- per-conversation work
def _first_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]] | None:
    """Messages before the first assistant turn (system and user turns), None without a user turn."""
    prefix = []
    for m in messages:
        if m["role"] == "assistant":
            if any(p["role"] == "user" for p in prefix):
                break
            continue  # an answer before any question: drop it
        prefix.append(m)
    return prefix if any(p["role"] == "user" for p in prefix) else None


def _open_generator(cfg: ExportConfig, hf_model: Path | None):
    from hetero_spec.engine.answers import AnswerGenerator, GenerateOptions

    # Hidden states straight from generation when nothing else is needed from a second pass: rows of
    # several sequences in one <=32-row batch are bit-identical to LlamaTarget's prefill (tested), and
    # this skips re-decoding every sequence.
    fused = cfg.topk == 0 and not cfg.layers and hf_model is None
    return AnswerGenerator(cfg.model, GenerateOptions(n_seq=cfg.n_seq, max_new_tokens=cfg.max_new_tokens,
                                                     seq_ctx=cfg.max_len, temperature=cfg.temperature,
                                                     seed=cfg.seed or 0, n_threads=cfg.threads, hidden=fused))


def _open_taps(cfg: ExportConfig):
    """The eval-callback context: intermediate blocks, and without top-k no LM head at all
    (about a quarter of SmolLM2's per-row cost: its head is a fifth of the weights)."""
    from hetero_spec.target.layer_taps import LayerTapTarget

    return LayerTapTarget(cfg.model, cfg.layers, n_ctx=cfg.max_len, n_batch=min(cfg.prefill_batch, cfg.max_len),
                          n_threads=cfg.threads, skip_head=not cfg.topk)


def _encode_chunk(chunk: list[Conversation], renderer: ChatRenderer, gen, cfg: ExportConfig,
                  skipped: Counter) -> list[tuple[list[int], list[int], np.ndarray | None]]:
    """(ids, mask, hidden or None) per kept conversation of the chunk, in order; skips are counted by reason."""
    from hetero_spec.chat_template import TemplateRenderError

    out: dict[int, tuple[list[int], list[int], np.ndarray | None]] = {}
    prompts: list[tuple[int, list[int]]] = []
    for c in chunk:
        try:
            if cfg.regenerate:
                prefix = _first_prompt(c.messages)
                if prefix is None:
                    skipped["no_user_turn"] += 1
                    continue
                ids = renderer.prompt_ids(prefix)
                if len(ids) + cfg.max_new_tokens > cfg.max_len:
                    skipped["prompt_too_long"] += 1
                    continue
                prompts.append((c.index, ids))
            else:
                ids, mask = renderer.encode(c.messages)
                if len(ids) > cfg.max_len:
                    ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
                    skipped["truncated_to_max_len(kept)"] += 1
                if not any(mask):
                    skipped["no_assistant_tokens"] += 1
                    continue
                out[c.index] = (ids, mask, None)
        except TemplateRenderError:
            skipped["template_error"] += 1
    if prompts:
        ids_of = dict(prompts)
        for key, answer, hidden in gen.generate(prompts):
            if not gen.is_eog(answer[-1]):
                skipped["hit_max_new_tokens(kept)"] += 1
            out[key] = (ids_of[key] + answer, [0] * len(ids_of[key]) + assistant_mask(answer, gen.is_eog), hidden)
    return [out[c.index] for c in chunk if c.index in out]


def _topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits ``[n, V] f32`` -> top-k ids ``[n, k] int32`` (best first) and their log-probs ``[n, k] f32``."""
    idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, idx, axis=1)
    order = np.argsort(-vals, axis=1)
    idx, vals = np.take_along_axis(idx, order, 1), np.take_along_axis(vals, order, 1)
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    return idx.astype(np.int32), vals - lse


def extract(target, ids: list[int], topk: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Decode ``ids`` from an empty cache in 32-row micro-batches, as the runtime does.

    Returns hidden ``[T, n_embd] float32`` and, with ``topk``, the target's top-k next-token
    ids ``[T, k] int32`` and log-probabilities ``[T, k] float32`` at every position.
    """
    target.reset()
    step = target.options.n_batch
    hidden = np.empty((len(ids), target.n_embd), dtype=np.float32)
    top_ids = np.empty((len(ids), topk), dtype=np.int32) if topk else None
    top_lp = np.empty((len(ids), topk), dtype=np.float32) if topk else None
    for a in range(0, len(ids), step):
        logits, h = target.verify(ids[a : a + step])  # views: copied below
        b = a + len(h)
        hidden[a:b] = h
        if topk:
            top_ids[a:b], top_lp[a:b] = _topk(logits, topk)
    return hidden, top_ids, top_lp


def _features(target, ids: list[int], mask: list[int], cfg: ExportConfig, taps=None,
              hidden: np.ndarray | None = None) -> FeatureSequence:
    extras: dict[str, np.ndarray] = {}
    if hidden is not None:  # already computed during generation
        pass
    elif taps is not None:  # the eval-callback context decodes instead (intermediate blocks, or no head)
        top_ids = np.empty((len(ids), cfg.topk), dtype=np.int32)
        top_lp = np.empty((len(ids), cfg.topk), dtype=np.float32)

        def keep_topk(a: int, logits: np.ndarray) -> None:
            top_ids[a : a + len(logits)], top_lp[a : a + len(logits)] = _topk(logits, cfg.topk)

        hidden, layers = taps.run(ids, keep_topk if cfg.topk else None)
        extras.update({f"layer_{i}": v.astype(DTYPES[cfg.dtype]) for i, v in layers.items()})
    else:
        hidden, top_ids, top_lp = extract(target, ids, cfg.topk)
    if cfg.topk:
        extras.update(topk_ids=top_ids, topk_logprobs=top_lp.astype(np.float16))
    return FeatureSequence(np.asarray(ids, dtype=np.int32), hidden.astype(DTYPES[cfg.dtype]),
                           np.asarray(mask, dtype=np.uint8), extras)


def merge_datasets(parts: list[Path], out: Path) -> Manifest:
    """Merge complete exports of the same source and settings (e.g. ``--shard i/N`` parts) into ``out``.

    Shards are hard-linked when the file system allows it (copied otherwise) and renumbered;
    per-conversation skip counts add up.
    """
    if not parts:
        raise ExportError("nothing to merge")
    ms = [read_manifest(p) for p in parts]
    first = ms[0]

    def key(m: Manifest) -> tuple:
        src = {k: v for k, v in m.source.items() if k != "selection"}
        sel = {k: v for k, v in m.source.get("selection", {}).items() if k != "shard"}
        opts = {k: v for k, v in m.options.items() if k != "progress"}
        return (m.fingerprint, m.dtype, json.dumps([src, sel, opts], sort_keys=True))

    for p, m in zip(parts, ms):
        if key(m) != key(first):
            raise ExportError(f"{p} was exported from another target, source or settings than {parts[0]}")
        if not m.options.get("progress", {}).get("done"):
            raise ExportError(f"{p} is not complete; finish it first (rerun its export command)")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "manifest.json").exists():
        raise ExportError(f"{out} already holds a dataset; merge into a new folder")
    merged = Manifest(fingerprint=first.fingerprint, dtype=first.dtype, template=first.template,
                      source=dict(first.source, selection=dict(first.source["selection"],
                                                              shard=[m.source["selection"]["shard"] for m in ms])),
                      options=dict(first.options, merged_from=[str(p) for p in parts]), skipped={})
    for p, m in zip(parts, ms):
        for info in m.shards:
            dst = out / shard_name(len(merged.shards))
            try:
                os.link(p / info.file, dst)
            except OSError:
                shutil.copyfile(p / info.file, dst)
            merged.shards.append(ShardInfo(dst.name, info.n_sequences, info.n_tokens, info.n_loss_tokens))
        for k, v in m.skipped.items():
            merged.skipped[k] = merged.skipped.get(k, 0) + v
    write_manifest(out, merged)
    return merged
