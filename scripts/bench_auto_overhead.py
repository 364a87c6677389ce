"""Where auto loses to plain decoding when it barely drafts: one context, four loops, interleaved.

    python scripts/bench_auto_overhead.py MODEL.gguf DRAFT.safetensors --n-prompts 8

raw    the bare low-level loop (the bench's baseline) on hetero-spec's own context
plain  hetero-spec with draft_len=0 (the runtime's own plain path)
never  the speculative loop with a policy that never drafts (undrafted rounds, embeddings on)
auto   --draft-len auto --no-suffix (probes, prompt lookup and drafting where it expects a gain)

Prints, per loop, the median over prompts of speed, prefill time and decode speed against raw; then
each loop's one-row decodes against raw's at the same position of the same prompt (the llama_decode
alone, no bookkeeping), split by whether the decode before it was a plain one-row decode or not (a
different shape makes llama.cpp build a new graph); then the Python time between two consecutive
one-row decodes, the loop's own cost per plain token (after a decode the CPU's caches are cold, so
every line counts: trimming it cut auto's from about 370 to 290 us on SmolLM2 Q4_0, raw's being 190).
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import click

from hetero_spec.api import HeteroSpec
from hetero_spec.bench.baselines import RawRun
from hetero_spec.bench.harness import load_dataset
from hetero_spec.spec.policy import FixedPolicy, Shape


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--datasets", default="mt_bench,alpaca", show_default=True)
@click.option("--n-prompts", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(2))
@click.option("--threads", "-t", default=0, type=click.IntRange(0))
def main(model, draft, datasets, n_prompts, max_new_tokens, threads) -> None:
    with HeteroSpec(model, draft, threads=threads) as hs:
        raw = RawRun(hs)
        prompts = [hs.target.tokenize(hs.render([{"role": "user", "content": text}]), add_special=False)
                   for name in datasets.split(",") for text in load_dataset(name, n_prompts).prompts]
        never = FixedPolicy(Shape(0))
        auto_policy = hs._policy
        decodes: list[tuple[int, bool, float, float]] = []  # (position decoded, after another shape, start, end)
        _time_one_row_decodes(hs, raw, decodes)
        paired: dict[str, list[float]] = defaultdict(list)
        this_prompt: dict[str, dict[int, tuple[bool, float]]] = {}  # per loop, its one-row decodes by position
        gaps: dict[str, list[float]] = defaultdict(list)  # per loop, seconds between consecutive one-row decodes

        def run(prompt, name):
            decodes.clear()
            out = _run(prompt, name)
            this_prompt[name] = {pos: (after_other, end - start) for pos, after_other, start, end in decodes}
            gaps[name] += [b[2] - a[3] for a, b in zip(decodes, decodes[1:]) if b[0] == a[0] + 1 and not b[1]]
            return out

        def _run(prompt, name):
            if name == "raw":
                r = raw.run(prompt, max_new_tokens)
                return r.wall_s, r.prefill_s, r.new_tokens, r.tokens
            hs._policy = (lambda cfg, suffix=False: never) if name == "never" else auto_policy
            hs.reset()
            t0 = time.perf_counter()
            out = hs.generate(prompt, max_new_tokens=max_new_tokens, draft_len=0 if name == "plain" else "auto",
                              suffix=False)
            return time.perf_counter() - t0, out.stats.prefill_s, len(out.tokens), out.tokens

        hs.generate(prompts[0], max_new_tokens=4, draft_len="auto", suffix=False)  # calibration and warm-up outside the timing
        names = ["raw", "plain", "never", "auto"]
        res: dict[str, list] = {n: [] for n in names}
        for j, prompt in enumerate(prompts):
            for name in names[j % 4:] + names[: j % 4]:
                res[name].append(run(prompt, name))
            base_times = this_prompt["raw"]
            for name in ("plain", "never", "auto"):
                for pos, (after_other, s) in this_prompt[name].items():
                    if pos in base_times:
                        after = "a multi-row or embeddings-on decode" if after_other else "a plain one"
                        paired[f"{name}, after {after}"].append(s / base_times[pos][1])
        base = res["raw"]
        for name, rs in res.items():
            speed = statistics.median(b[0] / r[0] * r[2] / b[2] for r, b in zip(rs, base))
            prefill = statistics.median(r[1] / b[1] for r, b in zip(rs, base))
            decode = statistics.median(((b[0] - b[1]) / (b[2] - 1)) / ((r[0] - r[1]) / (r[2] - 1))
                                       for r, b in zip(rs, base) if r[2] > 1 and b[2] > 1)
            same = sum(r[3] == b[3] for r, b in zip(rs, base))
            click.echo(f"{name:6s} speed {speed:.3f}  prefill time x{prefill:.3f}  decode speed {decode:.3f}  "
                       f"equal to raw {same}/{len(rs)}")

        for key, ratios in sorted(paired.items()):
            click.echo(f"one-row decode against raw's at the same position: {key}: "
                       f"x{statistics.median(ratios):.3f} (median of {len(ratios)})")
        for name in (n for n in names if gaps[n]):
            click.echo(f"Python between consecutive one-row decodes, {name}: {1e6 * statistics.median(gaps[name]):.0f} us "
                       f"(median of {len(gaps[name])})")


def _time_one_row_decodes(hs: HeteroSpec, raw: RawRun, out: list[tuple[int, bool, float, float]]) -> None:
    """Wrap both loops' decode calls so that every one-row decode lands in ``out``."""
    target, loop = hs.target, raw.loop
    verify, verify_tree, decode, generate = target.verify, target.verify_tree, loop._decode, loop.generate
    other_shape = [False]  # whether the previous decode had other rows or embeddings on (a new graph)
    cached = [0]  # the raw loop's cells (counted here: a ctypes query would land in the timed gap)

    def timed_verify(tokens):
        pos, after_other, t0 = target.n_past, other_shape[0], time.perf_counter()
        result = verify(tokens)
        if len(tokens) == 1 and not target.embeddings:
            out.append((pos, after_other, t0, time.perf_counter()))
        other_shape[0] = target.embeddings or len(tokens) > 1
        return result

    def timed_verify_tree(*args):
        other_shape[0] = True  # lookup and drafted rounds: several rows, embeddings on
        return verify_tree(*args)

    def timed_decode(tokens):
        t0 = time.perf_counter()
        decode(tokens)
        t1 = time.perf_counter()
        if len(tokens) == 1:
            out.append((cached[0], False, t0, t1))
        cached[0] += len(tokens)

    def counted_generate(prompt, max_new_tokens):
        cached[0] = 0  # the loop clears its cache first
        return generate(prompt, max_new_tokens)

    target.verify, target.verify_tree, loop._decode, loop.generate = (timed_verify, timed_verify_tree, timed_decode,
                                                                      counted_generate)


if __name__ == "__main__":
    main()
