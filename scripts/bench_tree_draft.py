"""A greedy tree's drafting on the CPU: the native step against torch's forward, as ``run --tree`` drafts.

    python scripts/bench_tree_draft.py "$(python scripts/default_model.py)" drafts/smollm2-135m-darter.safetensors \
        --shape 3,2,2 --shape 12,6,2 --json tree-draft.json

Per tree shape (``--shape TOKENS,DEPTH,TOP_K``, as ``--tree-tokens/--tree-depth/--tree-top-k``), every prompt
(the first ``--n-prompts`` of mt_bench and gsm8k) is generated greedily both ways, taking turns prompt by
prompt so that a drifting machine moves both alike:

  native  the runtime: the round's real rows read, every level's nodes forwarded and every level's head ranked
          by the native step (``draft/native.py``)
  torch   the same draft with its native step taken away: torch's forward and head for the rows and each level

Prints per shape and way the median draft time of a tree round (``Round.draft_s``: the rows read, every
level's forward and head), the median wall time of a prompt, the mean accepted length, and how many outputs
equal plain decoding's.  ``--json FILE`` writes the same figures.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click

from hetero_spec.api import HeteroSpec
from hetero_spec.bench.command import model_arg
from hetero_spec.bench.prompts import load_dataset
from hetero_spec.calibration import machine_id
from hetero_spec.config import TreeSpec
from hetero_spec.cpu_features import cpu_info

WAYS = ("native", "torch")


def parse_shape(text: str) -> TreeSpec:
    try:
        tokens, depth, top_k = (int(v) for v in text.split(","))
        return TreeSpec(tokens, depth, top_k)
    except (ValueError, TypeError) as err:
        raise click.BadParameter(f"{text!r} is not TOKENS,DEPTH,TOP_K ({err})") from None


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("draft", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--shape", "shapes", multiple=True, default=("3,2,2", "12,6,2"), show_default=True,
              help="TOKENS,DEPTH,TOP_K of a tree (repeatable)")
@click.option("--n-prompts", default=6, show_default=True, type=click.IntRange(1), help="prompts per set")
@click.option("--max-tokens", default=96, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1), help="passes over the prompts")
@click.option("-t", "--threads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="write the figures here")
def main(model: Path, draft: Path, shapes: tuple[str, ...], n_prompts: int, max_tokens: int, repeats: int,
         threads: int, json_out: Path | None) -> None:
    trees = [parse_shape(s) for s in shapes]
    hs = HeteroSpec(model, draft, threads=threads)
    runner = hs.draft
    native = runner._native
    if native is None:
        raise click.ClickException("this draft has no native step here (no compiler, or HETERO_SPEC_NATIVE_DRAFT=0)")
    prompts = [hs.target.tokenize(hs.render([{"role": "user", "content": text}]), add_special=False, parse_special=True)
               for name in ("mt_bench", "gsm8k") for text in load_dataset(name, n_prompts).prompts]
    plain = []
    for ids in prompts:
        hs.reset()
        plain.append(hs.generate(ids, max_new_tokens=max_tokens, draft_len=0).tokens)
    figures = []
    with click.progressbar(length=len(trees) * repeats * len(prompts) * len(WAYS), label="tree rounds",
                           file=sys.stderr) as bar:
        for tree in trees:
            draft_s = {w: [] for w in WAYS}
            wall = {w: [] for w in WAYS}
            emitted = {w: [] for w in WAYS}
            equal = {w: 0 for w in WAYS}
            for r in range(repeats):
                for j, ids in enumerate(prompts):
                    for way in WAYS if (j + r) % 2 == 0 else WAYS[::-1]:
                        runner._native = native if way == "native" else None
                        hs.reset()
                        t0 = time.perf_counter()
                        out = hs.generate(ids, max_new_tokens=max_tokens, draft_len=1, tree=tree)
                        wall[way].append(time.perf_counter() - t0)
                        rounds = [rd for rd in out.stats.rounds if rd.drafted]
                        draft_s[way] += [rd.draft_s for rd in rounds]
                        emitted[way] += [rd.emitted for rd in rounds]
                        equal[way] += out.tokens == plain[j]
                        bar.update(1)
            runner._native = native
            row = {"tree": {"tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k}}
            for way in WAYS:
                row[way] = {"draft_ms_per_round": 1e3 * statistics.median(draft_s[way]), "rounds": len(draft_s[way]),
                            "wall_s_per_prompt": statistics.median(wall[way]),
                            "mean_accepted_length": statistics.mean(emitted[way]),
                            "equal_to_plain": equal[way], "runs": repeats * len(prompts)}
            figures.append(row)
            click.echo(f"tree {tree.total_tokens},{tree.depth},{tree.top_k}: " + "; ".join(
                f"{w} {row[w]['draft_ms_per_round']:.2f} ms a round's drafting, {row[w]['wall_s_per_prompt']:.3f} s a "
                f"prompt, {row[w]['mean_accepted_length']:.2f} accepted, {row[w]['equal_to_plain']}/{row[w]['runs']} "
                f"equal to plain" for w in WAYS))
    hs.close()
    if json_out:
        command = (f'python scripts/bench_tree_draft.py {model_arg(model)} {draft} '
                   + " ".join(f"--shape {s}" for s in shapes) + f" --n-prompts {n_prompts} --max-tokens {max_tokens} "
                   f"--repeats {repeats} -t {threads} --json {json_out}")
        meta = {"command": command, "machine": machine_id(threads), "cpu_brand": cpu_info()[0], "model": model.name,
                "draft": draft.name, "sets": ["mt_bench", "gsm8k"], "n_prompts": n_prompts, "max_tokens": max_tokens,
                "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        json_out.write_text(json.dumps({"meta": meta, "trees": figures}, indent=1))


if __name__ == "__main__":
    main()
