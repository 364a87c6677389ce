"""Tree vs chain on this machine: verification cost at equal token counts, per-round overhead,
and what auto sizing picks.  Medians of interleaved timings.

    python scripts/bench_tree.py [--draft DRAFT.safetensors] [--repeats 15] [--tokens 32] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero_spec.api import HeteroSpec  # noqa: E402
from hetero_spec.config import TreeSpec  # noqa: E402
from hetero_spec.default_model import shipped_model_path  # noqa: E402
from hetero_spec.spec.policy import best_shape  # noqa: E402
from hetero_spec.spec.tree import Tree  # noqa: E402


def beam_tree(root: int, n: int, width: int) -> Tree:
    """The shape propose_tree builds: ``width`` nodes per depth, each child of the depth's first node."""
    parents, prev_first = [-1], 0
    while len(parents) < n + 1:
        first = len(parents)
        for _ in range(min(width, n + 1 - len(parents))):
            parents.append(prev_first)
        prev_first = first
    return Tree(np.array([root] + [1000 + i for i in range(n)]), np.array(parents))


def verify_costs(hs: HeteroSpec, repeats: int) -> dict:
    t = hs.target
    prompt = t.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    t.reset()
    t.set_embeddings(True)
    t.prefill(prompt[:-1])
    n0 = t.n_past
    out = {}
    for n in (7, 12, 16):
        tree = beam_tree(prompt[-1], n, 2)
        chain, tr = [], []
        for _ in range(repeats):
            a = time.perf_counter()
            t.verify(list(tree.tokens))
            b = time.perf_counter()
            t.rollback(n0)
            c = time.perf_counter()
            t.verify_tree(tree.tokens, tree.depth, tree.seq_ids)
            t.keep_branch(tree.seq_of(0), [int(tree.tokens[0])])
            d = time.perf_counter()
            t.rollback(n0)
            chain.append(b - a)
            tr.append(d - c)
        out[n] = {"chain_ms": 1e3 * statistics.median(chain), "tree_ms": 1e3 * statistics.median(tr),
                  "ratio": statistics.median([x / y for x, y in zip(tr, chain)])}
    t.reset()
    return out


def round_overheads(hs: HeteroSpec, n_tokens: int) -> dict:
    msgs = [{"role": "user", "content": "Explain why the sky is blue in a short paragraph."}]
    runs = {"chain k=4": dict(draft_len=4), "tree 12/6/2": dict(draft_len=6, tree=TreeSpec(12, 6, 2)),
            "chain k=4 (tree path)": dict(draft_len=6, tree=TreeSpec(4, 4, 1))}
    out = {}
    for name, opts in runs.items():
        hs.reset()
        s = hs.chat(msgs, max_new_tokens=n_tokens, **opts).stats
        n = max(len(s.rounds), 1)
        out[name] = {"overhead_ms_per_round": 1e3 * s.total("overhead_s") / n,
                     "draft_ms_per_round": 1e3 * s.total("draft_s") / n,
                     "verify_ms_per_round": 1e3 * s.total("verify_s") / n, "rounds": n}
    return out


def auto_choice(hs: HeteroSpec, n_tokens: int) -> dict:
    curve = hs.cost_curve()
    msgs = [{"role": "user", "content": "Write a limerick about a cat."}]
    hs.reset()
    s = hs.chat(msgs, max_new_tokens=n_tokens, draft_len="auto", lookup=False).stats  # the draft alone
    depths = [r.drafted for r in s.rounds]
    hypo = {f"alpha={a}": {"chain_k": best_shape(curve, [a] * 8, 1, 0, 8)[0].depth,
                           "tree_depth(w=2,12)": best_shape(curve, [min(1, a + 0.1)] * 6, 2, 12, 6)[0].depth}
            for a in (0.3, 0.5, 0.7, 0.8, 0.9)}
    return {"t(n)/t(1)": {n: round(curve.verify_ratio(n), 2) for n in (2, 4, 8, 13, 17)},
            "t1_ms": curve.verify_ms[1], "draft_step_ms": curve.draft_step_ms,
            "untrained: drafted per round": {d: depths.count(d) for d in sorted(set(depths))},
            "optimum for a draft accepted at a constant rate": hypo}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None,
                    help="a draft file (default: an untrained darter, made once in hetero-spec's cache)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="target threads (0 = physical cores)")
    args = ap.parse_args()
    model = args.model or shipped_model_path()
    if args.draft is None:
        from hetero_spec.target.gguf_weights import cache_dir

        args.draft = cache_dir() / "bench-tree" / "untrained-darter.safetensors"
        args.draft.parent.mkdir(parents=True, exist_ok=True)
    if not Path(args.draft).exists():
        from hetero_spec.draft_factory import create_draft

        create_draft(model, args.draft, preset="darter", reduced_vocab=8192, seed=1)
    with HeteroSpec(model, args.draft, n_ctx=2048, threads=args.threads, draft_device="cpu") as hs:
        res = {"verify": verify_costs(hs, args.repeats), "rounds": round_overheads(hs, args.tokens),
               "auto": auto_choice(hs, args.tokens)}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
