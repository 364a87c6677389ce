"""Sweep draft shapes side by side: fixed chains, fixed trees, auto, and sampling, in one interleaved bench.

    python scripts/sweep_shapes.py MODEL.gguf DRAFT.safetensors --n-prompts 5 --out sweep-out

Answers the tree/auto/sampling questions in one run, with every method on the same prompts
and machine drift shared (``hetero-spec bench``'s harness): which fixed setting is best,
whether ``auto`` comes within 5% of it, whether the best tree is at least as fast as the
best chain, and how much of the greedy speedup sampling at ``--temperature`` keeps
(speculative sampled vs plain sampled, against speculative greedy vs raw greedy).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from hetero_spec.bench.baselines import BenchTarget
from hetero_spec.bench.harness import BASELINE, BenchConfig, Method, register, run_bench
from hetero_spec.bench.report import summarize, write_bench
from hetero_spec.config import SamplingConfig, TreeSpec
from hetero_spec.target.llama_target import default_threads


def _register(chains: list[int], trees: list[TreeSpec], best_k: int, temperature: float) -> list[str]:
    names = []

    def add(name: str, desc: str, options: dict) -> None:
        register(Method(name, desc, lambda c, o=options: c.hetero_run(**o), needs_draft=True, speculative=True))
        names.append(name)

    for k in chains:
        add(f"chain-k{k}", f"chain, {k} drafts", {"draft_len": k})
    for t in trees:
        add(f"tree-{t.total_tokens}-{t.depth}-{t.top_k}", f"tree {t}", {"draft_len": 1, "tree": t})
    add("auto", "auto chain", {"draft_len": "auto"})
    add("auto-tree", f"auto tree within {trees[-1]}", {"draft_len": "auto", "tree": trees[-1]})
    sampling = SamplingConfig(temperature=temperature, seed=7)
    register(Method("plain-sampled", f"plain decoding, T={temperature}",
                    lambda c: c.hetero_run(draft_len=0, sampling=sampling)))
    names.append("plain-sampled")
    add(f"chain-k{best_k}-sampled", f"chain k={best_k}, T={temperature}", {"draft_len": best_k, "sampling": sampling})
    return names


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--datasets", default="mt_bench,humaneval,gsm8k,alpaca", show_default=True)
@click.option("--n-prompts", default=5, show_default=True, type=click.IntRange(1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(1))
@click.option("--chains", default="1,2,3,4", show_default=True, help="fixed chain lengths")
@click.option("--trees", default="6,3,2;8,4,2;12,6,2", show_default=True,
              help="fixed trees as tokens,depth,top_k; the last also bounds auto-tree")
@click.option("--sampled-k", default=2, show_default=True, type=click.IntRange(1), help="chain length sampled")
@click.option("--temperature", default=0.7, show_default=True, type=click.FloatRange(0, min_open=True))
@click.option("--threads", "-t", default=0, type=click.IntRange(0))
@click.option("--out", default="sweep-out", show_default=True, type=click.Path(file_okay=False, path_type=Path))
def main(model, draft, datasets, n_prompts, max_new_tokens, chains, trees, sampled_k, temperature, threads, out):
    chain_ks = [int(x) for x in chains.split(",") if x]
    tree_specs = [TreeSpec(*(int(v) for v in t.split(","))) for t in trees.split(";") if t]
    methods = _register(chain_ks, tree_specs, sampled_k, temperature)
    cfg = BenchConfig(target=BenchTarget(model, draft, threads=threads or default_threads(), n_ctx=2048),
                      datasets=tuple(datasets.split(",")), methods=(BASELINE, *methods), n_prompts=n_prompts,
                      max_new_tokens=max_new_tokens)
    from tqdm import tqdm

    with tqdm(desc="sweep", unit="run", total=n_prompts * len(cfg.datasets) * len(cfg.methods)) as bar:
        result = run_bench(cfg, progress=lambda m: bar.update(1))
    write_bench(result, out)
    rows = {(r["method"], r["dataset"]): r for r in summarize(result)}
    speed = {m: rows[(m, "all")]["speedup"] for m in methods}
    fixed = [m for m in methods if m.startswith(("chain-k", "tree-")) and not m.endswith("sampled")]
    best = max(fixed, key=speed.get)
    best_chain = max((m for m in fixed if m.startswith("chain")), key=speed.get)
    best_tree = max((m for m in fixed if m.startswith("tree")), key=speed.get)
    greedy_gain = speed[f"chain-k{sampled_k}"] if f"chain-k{sampled_k}" in speed else None
    sampled_gain = (rows[(f"chain-k{sampled_k}-sampled", "all")]["tokens_per_s"]
                    / rows[("plain-sampled", "all")]["tokens_per_s"])
    verdict = {
        "speedup_all": speed,
        "mean_accepted_length_all": {m: rows[(m, "all")]["mean_accepted_length"] for m in methods},
        "equal_to_raw": {m: f"{rows[(m, 'all')]['equal']}/{rows[(m, 'all')]['prompts']}" for m in methods},
        "best_fixed": best, "best_chain": best_chain, "best_tree": best_tree,
        "auto_over_best_fixed": speed["auto"] / speed[best],
        "auto_tree_over_best_fixed": speed["auto-tree"] / speed[best],
        "best_tree_over_best_chain": speed[best_tree] / speed[best_chain],
        "sampling_keeps_of_greedy_speedup": sampled_gain / greedy_gain if greedy_gain else None,
        "sampled_over_plain_sampled": sampled_gain,
    }
    (out / "sweep.json").write_text(json.dumps(verdict, indent=2))
    click.echo(json.dumps(verdict, indent=2))


if __name__ == "__main__":
    main()
