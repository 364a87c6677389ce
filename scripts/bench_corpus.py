"""Self-distillation throughput: single-sequence greedy generation against ``generate-corpus``'s bulk path.

Same GGUF, same threads, the same ShareGPT first prompts, greedy, the same answer cap.  Three ways,
repeated in rotating order, medians reported:
  single       one conversation at a time through LlamaTarget (prefill, then one token per decode):
               what plain self-distillation costs;
  bulk-ids     BulkGenerator, N conversations per decode, token ids only (the decode-only figure);
  corpus       the whole ``generate-corpus`` command: bulk decoding with features and EAGLE-3 taps,
               rendering, decontamination and shard writing (the whole-export figure).
Throughput counts generated assistant tokens per second of wall time.

``--stop-loops K`` adds ``corpus-stop``: the same command ending each turn K tokens into a repetition loop
(``generate-corpus --stop-loops K``).  Both corpus ways then also count the answer tokens that training with
``--loop-keep K`` scores (``train/loops.py``): the tokens a draft learns from, per second.  ``--ways`` picks
ways, ``--json`` keeps the runs.

    python scripts/bench_corpus.py "$(python scripts/default_model.py)" --ways corpus,corpus-stop --stop-loops 32 \
        --prompts 96 --max-new-tokens 256 --turns 2 --repeats 2 -t 2 --json corpus-stop.json

``--streams 1,4,16,32`` instead times one decode of S rows, one per sequence, each sequence holding
``--stream-ctx`` cells, over per-sequence KV streams and over one unified cache: the ceiling of any
bulk generator on this CPU.

    python scripts/bench_corpus.py "$(python scripts/default_model.py)" --prompts 48 -t 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from converters.corpus import CorpusConfig, _split_turns, generate_corpus
from converters.datasets import ChatRenderer, load_source, resolve_source, select
from hetero_spec.target.bulk_generate import BulkGenerator, BulkOptions
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


def prompts_of(model: Path, n: int, seed: int) -> tuple[list[tuple[int, list[int]]], int]:
    """The first ``n`` usable first prompts of the shuffled source, and how many conversations that took
    (so that ``generate-corpus --limit`` covers the same ones)."""
    convs = select(load_source(resolve_source(None)).conversations, limit=4 * n, seed=seed)
    out = []
    span = 0
    with LlamaTarget(model, TargetOptions(n_ctx=256, n_threads=1, embeddings=False)) as t:
        r = ChatRenderer(t.chat_template, t.bos_token, t.eos_token, lambda s: t.tokenize(s, add_special=False), t.is_eog)
        for span, c in enumerate(convs, 1):
            prompt, _ = _split_turns(c.messages)
            ids = r.prompt_ids(prompt) if prompt else []
            if 0 < len(ids) <= 1024:
                out.append((c.index, ids))
            if len(out) == n:
                break
    return out, span


def single(model: Path, prompts, max_new: int, threads: int) -> tuple[int, float]:
    generated = 0
    t0 = time.perf_counter()
    with LlamaTarget(model, TargetOptions(n_ctx=2048, n_threads=threads, embeddings=False)) as t:
        for _, ids in prompts:
            t.reset()
            _, logits = t.prefill(ids)
            for _ in range(max_new):
                tok = int(logits.argmax())
                generated += 1
                if t.is_eog(tok):
                    break
                logits = t.verify([tok])[0][-1]
    return generated, time.perf_counter() - t0


def bulk(model: Path, prompts, max_new: int, threads: int, n_seq: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with BulkGenerator(model, BulkOptions(n_seq=n_seq, max_new_tokens=max_new, n_threads=threads)) as g:
        generated = sum(sum(r.mask) for r in g.generate(prompts))
    return generated, time.perf_counter() - t0


def corpus(model: Path, span: int, max_new: int, threads: int, n_seq: int, seed: int, turns: int = 1,
           stop_loops: int = 0, keep: int = 0) -> tuple[int, float, dict]:
    """Generated assistant tokens, seconds, and counts: conversations, stops in a loop, and the answer tokens
    training with ``--loop-keep keep`` scores (with ``keep`` > 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m = generate_corpus(CorpusConfig(model=model, out=Path(tmp) / "c", limit=span, seed=seed, turns=turns,
                                         max_new_tokens=max_new, n_seq=n_seq, threads=threads, chunk=span,
                                         taps=(2, 15, 27), stop_loops=stop_loops), progress=False)
        seconds = time.perf_counter() - t0
        c = m["counts"]
        extra = dict(conversations=c["conversations"], stopped_in_loop=c.get("stopped_in_loop", 0))
        if keep:
            extra["scored"] = scored_tokens(Path(tmp) / "c", keep)
        return c["assistant_tokens"], seconds, extra


def scored_tokens(folder: Path, keep: int) -> int:
    """Answer tokens of a corpus that ``train --loop-keep keep`` scores."""
    from safetensors.numpy import load_file

    from hetero_spec.train.loops import loop_tail_mask

    total = 0
    for path in sorted((folder / "ids").glob("ids-*.safetensors")):
        t = load_file(str(path))
        starts = t["seq_starts"]
        for a, b in zip(starts[:-1], starts[1:]):
            total += int(loop_tail_mask(t["input_ids"][a:b], t["loss_mask"][a:b], keep).sum())
    return total


def stream_rows(model: Path, n_seq: int, unified: bool, threads: int, ctx: int, reps: int = 8) -> float:
    """Median seconds of one llama_decode of ``n_seq`` rows, one per sequence, after ``ctx`` cells each."""
    import numpy as np

    from hetero_spec.target import _ffi
    from hetero_spec.target._ffi import C, BatchHandle, ContextHandle, ModelHandle
    from hetero_spec.target.llama_target import kv_type_id

    _ffi.ensure_backend()
    rng = np.random.default_rng(0)
    m_handle = ModelHandle(model)
    ctx_h = b = None
    try:
        ctx_h = ContextHandle(m_handle, n_ctx=(ctx + 64) * n_seq, n_batch=512, n_threads=threads, embeddings=False,
                              n_seq_max=n_seq, kv_unified=unified, flash_attn=1, kv_type=kv_type_id("f16", m_handle))
        b = BatchHandle(512)
        for s in range(n_seq):
            b.token[:ctx], b.pos[:ctx] = rng.integers(100, 40000, ctx), np.arange(ctx)
            b.output[:ctx] = 0
            for i in range(ctx):
                b.seq_ids[i][0] = s
            b.raw.n_tokens = ctx
            _ffi.check_decode(C.llama_decode(ctx_h.ptr, b.raw))
        times = []
        for r in range(reps):
            for s in range(n_seq):
                b.token[s], b.pos[s], b.output[s], b.seq_ids[s][0] = 1000 + s, ctx + r, 1, s
            b.raw.n_tokens = n_seq
            t0 = time.perf_counter()
            _ffi.check_decode(C.llama_decode(ctx_h.ptr, b.raw))
            times.append(time.perf_counter() - t0)
    finally:
        for owner in (b, ctx_h, m_handle):
            if owner is not None:
                owner.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--n-seq", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=1, choices=(1, 2), help="the corpus ways' --turns")
    ap.add_argument("--stop-loops", type=int, default=0, help="K > 0: add corpus-stop, and count what --loop-keep K scores")
    ap.add_argument("--ways", help="comma-separated: single, bulk-ids, corpus, corpus-stop (default: all there are)")
    ap.add_argument("--json", type=Path, help="write every run and the medians here")
    ap.add_argument("--streams", help="comma-separated sequence counts: time one-row-per-sequence decodes instead")
    ap.add_argument("--stream-ctx", type=int, default=100, help="cells each sequence holds (--streams)")
    a = ap.parse_args()
    if a.streams:
        one = stream_rows(a.model, 1, False, a.threads, a.stream_ctx)
        for n in (int(x) for x in a.streams.split(",")):
            sep = one if n == 1 else stream_rows(a.model, n, False, a.threads, a.stream_ctx)
            uni = stream_rows(a.model, n, True, a.threads, a.stream_ctx) if n > 1 else sep
            print(f"{n:3d} sequences: per-sequence streams {sep * 1e3:7.1f} ms ({n / sep:5.0f} rows/s, "
                  f"{sep / one:5.2f} t(1)) | unified {uni * 1e3:7.1f} ms ({n / uni:5.0f} rows/s)", flush=True)
        return
    prompts, span = prompts_of(a.model, a.prompts, a.seed)
    ways = {
        "single": lambda: (*single(a.model, prompts, a.max_new_tokens, a.threads), {}),
        "bulk-ids": lambda: (*bulk(a.model, prompts, a.max_new_tokens, a.threads, a.n_seq), {}),
        "corpus": lambda: corpus(a.model, span, a.max_new_tokens, a.threads, a.n_seq, a.seed, a.turns,
                                 keep=a.stop_loops),
    }
    if a.stop_loops:
        ways["corpus-stop"] = lambda: corpus(a.model, span, a.max_new_tokens, a.threads, a.n_seq, a.seed, a.turns,
                                             stop_loops=a.stop_loops, keep=a.stop_loops)
    names = a.ways.split(",") if a.ways else list(ways)
    unknown = [n for n in names if n not in ways]
    if unknown:
        ap.error(f"unknown ways {unknown} (corpus-stop needs --stop-loops)")
    runs: list[dict] = []
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            tokens, seconds, extra = ways[name]()
            runs.append(dict(repeat=r, way=name, tokens=tokens, seconds=seconds, **extra))
            more = "".join(f" {k} {v}" for k, v in extra.items())
            print(f"repeat {r} {name:11s} {tokens:6d} tokens {seconds:7.1f} s {tokens / seconds:7.1f} tok/s{more}",
                  flush=True)
    medians = {}
    for name in names:
        mine = [x for x in runs if x["way"] == name]
        medians[name] = dict(seconds=statistics.median(x["seconds"] for x in mine),
                             tok_s=statistics.median(x["tokens"] / x["seconds"] for x in mine))
        if "scored" in mine[0]:
            medians[name]["scored_tok_s"] = statistics.median(x["scored"] / x["seconds"] for x in mine)
    base = names[0]
    for name in names:
        med = medians[name]
        scored = f", {med['scored_tok_s']:7.1f} scored tok/s" if "scored_tok_s" in med else ""
        print(f"{name:11s} median {med['seconds']:7.1f} s, {med['tok_s']:7.1f} tok/s{scored}; "
              f"{medians[base]['seconds'] / med['seconds']:5.2f}x {base}'s speed")
    if a.json:
        from hetero_spec.bench.command import script_command
        from hetero_spec.bench.server_load import cpu_name

        a.json.write_text(json.dumps(dict(command=script_command(sys.argv), cpu=cpu_name(), model=a.model.name,
                                          prompts=len(prompts), conversations=span,
                                          options=dict(vars(a), model=a.model.name, json=str(a.json)),
                                          runs=runs, medians=medians), indent=1))


if __name__ == "__main__":
    main()
