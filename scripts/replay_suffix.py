"""Replay the target's greedy answers through auto's real policy, suffix structure only, on named cost curves.

The suffix structure's acceptance does not depend on the machine, only on the target's greedy answers, so
how auto uses it can be judged offline and without the bench's noise, as ``scripts/replay_lookup.py`` does
for prompt lookup: each answer is generated once, then every round is replayed in the order the bench runs
the prompts (one shared cache of past answers, as ``bench``'s ``auto-suffix``), with the policy choosing from
what ``SuffixRequest`` proposes and learning from what the answer says verification would have accepted, by
the runtime's own rules (``spec/orchestrator.py``: verified rounds, whole chains checked on plain rounds,
the unverified rest of a chain accepted whole).  A round costs the curve's t(rows), which carries what the
round does to the plain decodes after it (calibration ``TIMING_VERSION`` 4), plus ``--rebuild`` t(1) whenever
its row count differs from the previous round's, for a curve timed without them (0 by default).  A round's
depth is capped where the answer ends, which the runtime does not know before an end-of-generation token:
answers that stop early replay a little better than they run.

It prints, per match bucket and depth, how often a chain's token was right given every token before it was
(the conditional acceptance auto's statistics estimate, ``SUFFIX_MATCH_BUCKETS``), and the modelled decode
speed over plain rounds per set for the variants asked for.

    python scripts/replay_suffix.py MODEL --curve results/calibration/X.json --tokens answers.json
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial

import click

from hetero_spec.api import AUTO_SUFFIX_DEPTH
from hetero_spec.calibration import CostCurve
from hetero_spec.spec.orchestrator import suffix_evidence
from hetero_spec.spec.policy import SUFFIX_MATCH_BUCKETS, AcceptanceStats, AutoPolicy, Shape, suffix_bucket
from hetero_spec.spec.shadow import ShadowChain
from hetero_spec.spec.suffix import SuffixCache, SuffixConfig, SuffixProposal, SuffixRequest, prompt_key
from replay_lookup import Answer, load_answers, load_curves, run_of_right  # the greedy answers, as bench renders the prompts


@dataclass(frozen=True)
class Variant:
    """What the replay changes: the deepest chain, whether the unverified rest of a chain is checked, and
    whether the buckets start from ``SUFFIX_PRIOR_ALPHAS`` (else from 0.5 at every depth)."""

    name: str
    depth: int
    tail: bool
    priors: bool = True


def accepted_run(prop: SuffixProposal, depth: int, chain: bool, truth: list[int]) -> tuple[list[int], int]:
    """(accepted tokens, rows verified) of a round that verifies ``prop`` cut at ``depth``, greedy."""
    if chain:
        nodes = prop.chain[:depth]
        return nodes[: run_of_right(nodes, truth)], len(nodes) + 1
    tokens, parents = prop.truncated(depth)
    out, node = [], 0
    while len(out) < len(truth):
        nxt = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == truth[len(out)]), None)
        if nxt is None:
            break
        out.append(tokens[nxt])
        node = nxt
    return out, len(tokens)


def conditional_table(answers: list[Answer], depth: int) -> dict[int, list[tuple[int, int]]]:
    """Per suffix bucket: (reached, right) per depth 1..depth of the proposed chain at every position."""
    table: dict[int, list[list[int]]] = defaultdict(lambda: [[0, 0] for _ in range(depth)])
    cache = SuffixCache(SuffixConfig(max_depth=depth))
    for a in answers:
        sfx = SuffixRequest(a.prompt, cache, key=prompt_key(a.prompt))
        sfx.extend(a.out[:1])
        for i in range(1, len(a.out)):
            prop = sfx.propose(tree=False, max_depth=depth)
            if prop is not None:
                row = table[suffix_bucket(prop.match, prop.cached)]
                for d, tok in enumerate(prop.chain[: len(a.out) - i]):
                    row[d][0] += 1
                    if tok != a.out[i + d]:
                        break
                    row[d][1] += 1
            sfx.extend(a.out[i : i + 1])
        sfx.finish()
    return {b: [tuple(x) for x in rows] for b, rows in sorted(table.items())}


def replay(answers: list[Answer], curve: CostCurve, rebuild: float, variant: Variant) -> tuple[dict, Counter]:
    """Per-set median of the modelled decode speed over plain rounds, and the rounds by depth verified."""
    policy = AutoPolicy(curve, max_depth=0, suffix_depth=variant.depth, suffix_nodes=12)
    if not variant.priors:
        policy.suffix_buckets = [AcceptanceStats(variant.depth, decay=b.decay) for b in policy.suffix_buckets]
    cache = SuffixCache(SuffixConfig(max_depth=variant.depth))
    t1 = curve.verify_time_ms(1)
    speed: dict[str, list[float]] = defaultdict(list)
    depths: Counter = Counter()
    for a in answers:
        policy.new_text()
        sfx = SuffixRequest(a.prompt, cache, key=prompt_key(a.prompt))
        sfx.extend(a.out[:1])
        i, cost, prev = 1, 0.0, 1
        chain_shadow, tail = ShadowChain(), ShadowChain()
        while i < len(a.out):
            prop = sfx.propose(tree=True, max_depth=policy.suffix_depth)
            shape = (policy.choose(0, 0, prop.sizes(), prop.match, prop.boost(), prop.cached) if prop
                     else policy.choose(0, 0, (), 0))
            depth = min(shape.depth, len(a.out) - i - 1) if shape.source == "suffix" and prop else 0
            suffix_round = depth > 0
            if suffix_round:
                got, rows = accepted_run(prop, depth, shape.width == 1, a.out[i:])
                nxt = a.out[i + len(got)]
                drafted = depth if shape.width == 1 else max(prop.depths[: rows])
                on_chain = 0
                while on_chain < len(got) and on_chain < len(prop.chain) and got[on_chain] == prop.chain[on_chain]:
                    on_chain += 1
                policy.observe(*suffix_evidence(prop.chain, drafted, len(got), on_chain, nxt, True), source="suffix")
                emitted = [*got, nxt]
                depths[depth] += 1
            else:
                rows, emitted = 1, a.out[i : i + 1]
                if prop is not None and not chain_shadow.guesses:
                    chain_shadow.open(prop.chain, partial(policy.observe_suffix_chain, prop.match, cached=prop.cached))
                depths[0] += 1
            ms = curve.verify_time_ms(rows) + (rebuild * t1 if rows != prev else 0.0)
            prev = rows
            policy.observe_time(Shape(rows - 1, rows - 1, rows - 1, source="suffix") if rows > 1 else Shape(0),
                                0, ms / 1e3)
            cost += ms
            if chain_shadow.guesses:
                chain_shadow.check(emitted)
            if tail.guesses:
                tail.check(emitted)
            if not tail.guesses and variant.tail and suffix_round and prop.chain[: len(emitted)] == emitted:
                rest = prop.chain[len(emitted) : policy.suffix_depth]
                if rest:
                    tail.open(rest, partial(policy.observe_suffix_tail, prop.match, prop.cached, len(emitted) + 1))
            sfx.extend(emitted)
            i += len(emitted)
        chain_shadow.close()
        tail.close()
        sfx.finish()
        speed[a.dataset].append((len(a.out) - 1) * t1 / cost)
    return {d: statistics.median(v) for d, v in speed.items()}, depths


VARIANTS = {v.name: v for v in (
    Variant("depth8-flat", 8, False, False),  # as the runtime before the tail and the priors, but chains past the tree
    Variant("depth8", 8, False),
    Variant("depth16-flat", 16, True, False),
    Variant("depth16-notail", 16, False),
    Variant("depth16", 16, True),  # the runtime's
)}


@click.command()
@click.argument("model")
@click.option("--curve", "curves", multiple=True, required=True,
              help="a shipped curve name (laptop-7b-q4_0, this-machine) or a calibration JSON; repeatable")
@click.option("--datasets", default="grounded,multiturn,agentic,mt_bench,humaneval,gsm8k,alpaca", show_default=True)
@click.option("--n-prompts", default=20, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--rebuild", default=0.0, show_default=True,
              help="t(1) added to a round whose row count changes (for curves timed without the decodes after each width)")
@click.option("--tokens", type=click.Path(dir_okay=False), help="cache of the greedy answers (JSON), reused if present")
@click.option("--variants", default=",".join(VARIANTS), show_default=True, help=f"from {', '.join(VARIANTS)}")
@click.option("-t", "--threads", default=1, show_default=True)
def main(model, curves, datasets, n_prompts, max_new_tokens, rebuild, tokens, variants, threads):
    chosen = [v for v in variants.split(",") if v]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise click.BadParameter(f"unknown variant {unknown[0]!r}: use {', '.join(VARIANTS)}", param_hint="--variants")
    answers = load_answers(model, tokens, datasets.split(","), n_prompts, threads, max_new_tokens)
    n = len(SUFFIX_MATCH_BUCKETS)
    print(f"conditional acceptance of the proposed chain by depth (right / reached), depth 1..{AUTO_SUFFIX_DEPTH}")
    for b, rows in conditional_table(answers, AUTO_SUFFIX_DEPTH).items():
        label = f"{'cache' if b >= n else 'own'} match >= {max(2, SUFFIX_MATCH_BUCKETS[b % n])}"
        cells = " ".join(f"{r / m:.2f}" if m else "-" for m, r in rows)
        print(f"{label:>18} ({rows[0][0]:5d} offers): {cells}")
    sets = list(dict.fromkeys(a.dataset for a in answers))
    print(f"\nmodelled decode speed over plain rounds (median per set), rebuild {rebuild} t(1)")
    for name, curve in load_curves(curves):
        for v in chosen:
            medians, depths = replay(answers, curve, rebuild, VARIANTS[v])
            cells = " ".join(f"{d} {medians[d]:.3f}" for d in sets)
            drafted = " ".join(f"{k}:{c}" for k, c in sorted(depths.items()) if k > 0 and c)
            print(f"{name[:40]:<40} {v:<13} {cells} | rounds by depth {drafted}")


if __name__ == "__main__":
    main()
