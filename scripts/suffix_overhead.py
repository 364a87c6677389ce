"""What the suffix structure adds to a round: extend by the round's tokens, then propose, timed per round.

Replays shipped bench prompts through the GGUF's tokenizer (no decoding): each prompt's first half is the
request's prompt and its second half arrives one token a round as the "output" (the worst case: every round
plain, so every round pays a query), with the earlier prompts' second halves in the cache of past outputs.
With ``--arctic DIR`` the same streams also run through arctic-inference's ``SuffixDecodingCache`` (a
folder holding its ``arctic_inference`` package with the built ``suffix_decoding._C`` extension):

    python scripts/suffix_overhead.py "$(python scripts/default_model.py)" --sets grounded,agentic,mt_bench -n 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero_spec.bench.prompts import load_dataset  # noqa: E402
from hetero_spec.spec.suffix import SuffixCache, SuffixRequest  # noqa: E402


def streams(model: Path, sets: list[str], n: int) -> list[tuple[list[int], list[int]]]:
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    t = LlamaTarget(model, TargetOptions(n_ctx=256, embeddings=False))
    try:
        out = []
        for name in sets:
            for p in load_dataset(name, n).prompts:
                text = p if isinstance(p, str) else "\n".join(m["content"] for m in p)
                ids = t.tokenize(text)
                out.append((ids[: len(ids) // 2], ids[len(ids) // 2 :]))
        return out
    finally:
        t.close()


def ours(pairs) -> tuple[list[float], int]:
    cache, times, proposed = SuffixCache(), [], 0
    for prompt, output in pairs:
        req = SuffixRequest(prompt, cache)
        for tok in output:
            t0 = time.perf_counter()
            req.extend([tok])
            prop = req.propose(tree=True)
            times.append(time.perf_counter() - t0)
            proposed += prop is not None
        req.finish()
    return times, proposed


def lookup(pairs) -> tuple[list[float], int]:
    """Today's prompt lookup on the same streams, as auto calls it every round."""
    from hetero_spec.spec.lookup import NgramLookup

    times, proposed = [], 0
    for prompt, output in pairs:
        look = NgramLookup(prompt)
        for tok in output:
            t0 = time.perf_counter()
            look.extend([tok])
            offered, _ = look.propose_matched(4, longest=8)
            times.append(time.perf_counter() - t0)
            proposed += bool(offered)
    return times, proposed


def arctic(pairs, folder: str) -> tuple[list[float], int]:
    sys.path.insert(0, folder)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache, times, proposed = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=1 << 20), [], 0
    for i, (prompt, output) in enumerate(pairs):
        cache.start_request(i, prompt)
        text = list(prompt)
        for tok in output:
            t0 = time.perf_counter()
            cache.add_active_response(i, [tok])
            text.append(tok)
            draft = cache.speculate(i, text[-32:], max_spec_tokens=12, use_tree_spec=True)
            times.append(time.perf_counter() - t0)
            proposed += len(draft.token_ids) > 0
        cache.stop_request(i)
    return times, proposed


def report(name: str, times: list[float], proposed: int) -> None:
    us = sorted(1e6 * t for t in times)
    print(f"{name}: {len(us)} rounds, a proposal in {100 * proposed / len(us):.0f}%; per round mean "
          f"{statistics.fmean(us):.1f} us, median {us[len(us) // 2]:.1f} us, p90 {us[9 * len(us) // 10]:.1f} us, "
          f"max {us[-1]:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--sets", default="grounded,multiturn,agentic,mt_bench,humaneval,gsm8k,alpaca")
    ap.add_argument("-n", type=int, default=8, help="prompts per set")
    ap.add_argument("--arctic", help="folder with arctic-inference's package and its built extension")
    args = ap.parse_args()
    pairs = streams(args.model, args.sets.split(","), args.n)
    report("prompt lookup (NgramLookup, Python)", *lookup(pairs))
    report("hetero-spec suffix (Python)", *ours(pairs))
    if args.arctic:
        report("arctic-inference SuffixDecodingCache (C++)", *arctic(pairs, args.arctic))


if __name__ == "__main__":
    main()
