"""Replay the target's greedy answers through auto's real policy, prompt lookup only, on named cost curves.

Acceptance does not depend on the machine (greedy output is the target's alone), so how auto
would use prompt lookup can be judged offline, far from the bench's noise (per-prompt speed
ratios spread by 5-10% on this VM): each answer is generated once, then every round is
replayed, with the policy choosing from what ``NgramLookup`` offers and learning from what the
answer says would have been accepted.  A round costs the curve's t(rows), which carries what
the round does to the plain decodes after it (calibration ``TIMING_VERSION`` 4), plus ``--rebuild``
t(1) whenever its row count differs from the previous round's, for curves timed without them
(``scripts/bench_shape_change.py``; 0 by default).  The draft model is left out (its acceptance
prior is set so low that it never pays); its probes count as plain rounds.

Two ways of learning are compared: "pooled" (one set of lookup statistics, first proposed token
checked on plain rounds: auto's earlier rule) and "by match" (statistics per match-length bucket,
whole proposals checked: ``AutoPolicy.observe_lookup_chain``).

    python scripts/replay_lookup.py MODEL --curve ~/.cache/hetero-spec/calibration/x10-t2-*.json \\
        --curve laptop-7b-q4_0 --tokens answers.json
"""
from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import click
from tqdm import tqdm

from hetero_spec.api import AUTO_LOOKUP_DEPTH
from hetero_spec.bench.projection import load_curve
from hetero_spec.bench.prompts import DATASETS, load_dataset
from hetero_spec.calibration import CostCurve
from hetero_spec.errors import HeteroSpecError
from hetero_spec.spec.lookup import NgramLookup, lookup_evidence
from hetero_spec.spec.shadow import ShadowChain
from hetero_spec.spec.policy import LOOKUP_MATCH_BUCKETS, AutoPolicy, Shape, lookup_bucket



@dataclass(frozen=True)
class Answer:
    dataset: str
    prompt: list[int]
    out: list[int]  # greedy new tokens, the first one from the prefill


def generate(model: str, datasets: list[str], n_prompts: int, threads: int, max_new: int) -> list[Answer]:
    from hetero_spec.api import HeteroSpec

    answers = []
    with HeteroSpec(model, None, threads=threads) as hs:
        jobs = [(d, p) for d in datasets for p in load_dataset(d, n_prompts).prompts]
        for dataset, text in tqdm(jobs, desc="greedy answers", unit="prompt"):
            hs.reset()
            turn = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)  # or a conversation
            prompt = hs.target.tokenize(hs.render(turn), add_special=False, parse_special=True)
            out = hs.generate(prompt, max_new_tokens=max_new, draft_len=0).tokens
            answers.append(Answer(dataset, prompt, out))
    return answers


def load_answers(model: str, tokens: str | None, datasets: list[str], n_prompts: int, threads: int,
                 max_new: int) -> list[Answer]:
    """The greedy answers from the ``tokens`` JSON cache where it exists, else generated (and cached there)."""
    cache = Path(tokens) if tokens else None
    if cache and cache.is_file():
        return [Answer(**a) for a in json.loads(cache.read_text())]
    answers = generate(model, datasets, n_prompts, threads, max_new)
    if cache:
        cache.write_text(json.dumps([a.__dict__ for a in answers]))
    return answers


def load_curves(specs: tuple[str, ...]) -> list[tuple[str, CostCurve]]:
    """(label, curve) of each ``--curve``: a shipped name or a calibration JSON; a clear error otherwise."""
    try:
        return [load_curve(spec) for spec in specs]
    except HeteroSpecError as exc:
        raise click.ClickException(str(exc)) from None


def run_of_right(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for p, t in zip(proposal, truth):
        if p != t:
            break
        n += 1
    return n


def match_table(answers: list[Answer]) -> dict[int, tuple[int, float, float]]:
    """Per match-length bucket: offers, share whose first token was right, mean run of right tokens (cap 32)."""
    runs: dict[int, list[int]] = defaultdict(list)
    for a in answers:
        look = NgramLookup(a.prompt + a.out[:1])
        for i in range(1, len(a.out)):
            offered, match = look.propose_matched(32)
            if offered:
                runs[lookup_bucket(match)].append(run_of_right(offered, a.out[i:]))
            look.extend(a.out[i : i + 1])
    return {b: (len(r), sum(x > 0 for x in r) / len(r), sum(r) / len(r)) for b, r in sorted(runs.items())}


def replay(answers: list[Answer], curve: CostCurve, rebuild: float, by_match: bool,
           lookup_depth: int) -> tuple[dict, float, Counter]:
    """Per-set median and overall mean of the modelled speed over plain rounds, and the round counts."""
    policy = AutoPolicy(curve, lookup_depth=lookup_depth, prior_alphas=(0.01,))
    t1 = curve.verify_time_ms(1)
    speed: dict[str, list[float]] = defaultdict(list)
    kinds: Counter = Counter()
    for a in answers:
        look = NgramLookup(a.prompt + a.out[:1])
        i, cost, prev, shadow = 1, 0.0, 1, ShadowChain()
        while i < len(a.out):
            offered, match = look.propose_matched(lookup_depth)
            match = match if by_match else 0
            shape = policy.choose(len(offered), match)
            rows, right = 1, 0
            depth = min(shape.depth, len(offered), len(a.out) - i - 1) if shape.source == "lookup" else 0
            if depth:  # the loop's cap: the tokens left
                right, rows = run_of_right(offered[:depth], a.out[i:]), depth + 1
                policy.observe(*lookup_evidence(offered, depth, right, a.out[i + depth], True), source="lookup")
                kinds["lookup"] += 1
            else:
                if shape.probe and shape.source == "draft":
                    policy.observe_probe(shape.depth, 0)
                if offered and by_match and not shadow.guesses:
                    shadow.open(offered, partial(policy.observe_lookup_chain, match))
                elif offered and not by_match:
                    policy.observe_shadow("lookup", float(offered[0] == a.out[i]))
                kinds["plain"] += 1
            ms = curve.verify_time_ms(rows) + (rebuild * t1 if rows != prev else 0.0)
            prev = rows
            policy.observe_time(Shape(rows - 1, source="lookup") if rows > 1 else Shape(0), 0, ms / 1e3)
            cost += ms
            emitted = a.out[i : i + right + 1]
            shadow.check(emitted)
            look.extend(emitted)
            i += len(emitted)
        shadow.close()
        speed[a.dataset].append((len(a.out) - 1) * t1 / cost)
    every = [s for v in speed.values() for s in v]
    return {d: statistics.median(v) for d, v in speed.items()}, sum(every) / len(every), kinds


@click.command()
@click.argument("model")
@click.option("--curve", "curves", multiple=True, required=True,
              help="a shipped curve name (laptop-7b-q4_0, this-machine) or a calibration JSON; repeatable")
@click.option("--datasets", default=",".join(DATASETS) + ",translate", show_default=True)
@click.option("--n-prompts", default=20, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--rebuild", default=0.0, show_default=True,
              help="t(1) added to a round whose row count changes (for curves timed without the decodes after each width)")
@click.option("--tokens", type=click.Path(dir_okay=False), help="cache of the greedy answers (JSON), reused if present")
@click.option("--lookup-depth", default=AUTO_LOOKUP_DEPTH, show_default=True, help="longest lookup chain")
@click.option("-t", "--threads", default=1, show_default=True)
def main(model, curves, datasets, n_prompts, max_new_tokens, rebuild, tokens, lookup_depth, threads):
    answers = load_answers(model, tokens, datasets.split(","), n_prompts, threads, max_new_tokens)
    bounds = list(LOOKUP_MATCH_BUCKETS[1:]) + [None]
    print("match length | offers | first token right | mean run of right tokens (cap 32)")
    for b, (n, first, run) in match_table(answers).items():
        hi = bounds[b]
        label = f">= {LOOKUP_MATCH_BUCKETS[b]}" if hi is None else f"{max(2, LOOKUP_MATCH_BUCKETS[b])}-{hi - 1}"
        print(f"{label:>12} | {n:6d} | {first:.3f} | {run:.2f}")
    sets = list(dict.fromkeys(a.dataset for a in answers))
    print(f"\nmodelled speed over plain rounds (median per set; mean over all prompts), rebuild {rebuild} t(1)")
    for name, curve in load_curves(curves):
        for by_match in (False, True):
            medians, mean, kinds = replay(answers, curve, rebuild, by_match, lookup_depth)
            label = "by match" if by_match else "pooled"
            cells = " ".join(f"{d} {medians[d]:.3f}" for d in sets)
            print(f"{name:<52} {label:<8} {cells} | mean {mean:.3f} | lookup rounds {kinds['lookup']}")


if __name__ == "__main__":
    main()
