"""Greedy losslessness on Gemma 3 270M over 20 prompts, through ``run``, the Python API and ``bench``.

The prompts are the first turns of the four shipped bench sets (5 each), in the plain template
(``User: ...\\n\\nAssistant:``, hetero_spec.chat_template.plain_prompt) since the base model has no
chat template.  The oracle is llama.cpp's simplest greedy loop on a context of its own
(``RawGreedy``); every other path must produce its text (run) or its token ids (API, bench):

  * run:   ``hetero-spec run MODEL --no-draft --raw``, and per draft ``-k 3`` (verification every
           round) and the default ``--draft-len auto``, one process per prompt;
  * API:   one ``HeteroSpec`` per draft, ``generate`` with ``draft_len=3`` and ``"auto"``, prompts in a row
           (so the KV prefix of the previous prompt is reused);
  * bench: ``hetero-spec bench --template plain --methods raw,chain,auto``; its raw text is also
           held against the oracle, so the bench decodes the same prompts.

    python scripts/check_gemma_lossless.py --draft new=new.safetensors --draft trained=trained.safetensors \\
        -t 1 --max-tokens 64 --out gemma-lossless.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.bench.results import load_bench_json
from hetero_spec.chat_template import plain_prompt

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")
CLI = [sys.executable, "-m", "hetero_spec"]


def prompts(per_set: int) -> list[str]:
    return [plain_prompt([{"role": "user", "content": q}]) for s in SETS for q in bench_prompts(s, per_set)]


def oracle(model: Path, texts: list[str], max_tokens: int, threads: int) -> list[tuple[list[int], str]]:
    from hetero_spec.config import DEFAULT_KV_TYPE
    from hetero_spec.target._ffi import ModelHandle
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions, kv_type_id
    from hetero_spec.target.raw_loop import RawGreedy

    handle = ModelHandle(model)
    raw = RawGreedy(handle, n_ctx=2048, n_threads=threads, kv_type=kv_type_id(DEFAULT_KV_TYPE, handle))
    out = []
    with LlamaTarget(model, TargetOptions(n_ctx=64, n_threads=1, embeddings=False)) as t:
        for p in texts:
            ids = raw.generate(t.tokenize(p), max_tokens)
            out.append((ids, t.detokenize([x for x in ids if not t.is_eog(x)])))
    raw.close()
    handle.close()
    return out


def check_run(model: Path, texts: list[str], ref, args, extra: list[str]) -> dict:
    """One ``hetero-spec run`` process per prompt; stdout must be the oracle's text plus a newline."""
    bad, t0 = [], time.perf_counter()
    for i, p in enumerate(texts):
        r = subprocess.run(CLI + ["run", str(model), *extra, "--raw", "-p", p, "-n", str(args.max_tokens),
                                  "-t", str(args.threads), "--draft-device", "cpu"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"run {' '.join(extra)} failed: {r.stderr.strip()[-300:]}")
        if r.stdout != ref[i][1] + "\n":
            bad.append(i)
    return {"equal": len(texts) - len(bad), "of": len(texts), "diverged": bad, "wall_s": round(time.perf_counter() - t0, 1)}


def check_api(model: Path, draft: Path, texts: list[str], ref, args) -> dict:
    from hetero_spec.api import HeteroSpec

    res = {}
    with HeteroSpec(model, draft, n_ctx=2048, threads=args.threads, draft_device="cpu") as hs:
        for k in (3, "auto"):
            bad, new, drafted, accepted, rounds, t0 = [], 0, 0, 0, 0, time.perf_counter()
            for i, p in enumerate(texts):
                out = hs.generate(p, max_new_tokens=args.max_tokens, draft_len=k)
                bad += [i] if out.tokens != ref[i][0] else []
                new += len(out.tokens)
                rounds += len(out.stats.rounds)
                drafted += sum(r.drafted for r in out.stats.rounds)
                accepted += sum(r.accepted for r in out.stats.rounds)
            wall = time.perf_counter() - t0
            res[f"k={k}"] = {"equal": len(texts) - len(bad), "of": len(texts), "diverged": bad, "wall_s": round(wall, 1),
                             "tok_s": round(new / wall, 1), "drafted": drafted, "accepted": accepted,
                             "mean_accepted_length": round(new / max(rounds, 1), 3)}
    return res


def check_bench(model: Path, draft: Path, texts: list[str], ref, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run(CLI + ["bench", str(model), str(draft), "--template", "plain", "--methods", "raw,chain,auto",
                                  "--datasets", ",".join(SETS), "--n-prompts", str(args.per_set), "--k", "3",
                                  "--max-new-tokens", str(args.max_tokens), "-t", str(args.threads), "--out", out],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench failed: {r.stderr.strip()[-300:]}")
        records = load_bench_json(Path(out) / "bench.json").records
    res = {}
    for m in ("raw", "chain", "auto"):
        rows = [x for x in records if x.method == m]
        res[m] = {"equal_to_raw": sum(x.equal for x in rows), "of": len(rows),
                  "median_tok_s": round(sorted(x.tokens_per_s for x in rows)[len(rows) // 2], 1)}
    raw = {(x.dataset, x.index): x.text for x in records if x.method == "raw"}
    order = [(s, i) for s in SETS for i in range(args.per_set)]
    res["raw_equal_to_oracle"] = sum(raw[key] == ref[j][1] for j, key in enumerate(order))
    return res


def main() -> None:
    from hetero_spec.default_model import gemma_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="default: the Gemma 3 target (scripts/default_model.py --gemma)")
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=PATH", help="repeatable")
    ap.add_argument("--per-set", type=int, default=5, help="prompts per bench set (4 sets)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", "-t", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: run, api, bench")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = args.model or gemma_model_path()
    drafts = dict(d.split("=", 1) for d in args.draft)
    skip = set(filter(None, args.skip.split(",")))
    texts = prompts(args.per_set)
    t0 = time.perf_counter()
    ref = oracle(model, texts, args.max_tokens, args.threads)
    report: dict = {"model": model.name, "prompts": len(texts), "max_tokens": args.max_tokens, "threads": args.threads,
                    "oracle_s": round(time.perf_counter() - t0, 1), "run": {}, "api": {}, "bench": {}}
    print(f"{model.name}: {len(texts)} prompts, oracle in {report['oracle_s']} s", flush=True)
    if "run" not in skip:
        report["run"]["no-draft"] = check_run(model, texts, ref, args, ["--no-draft"])
        print("run --no-draft", report["run"]["no-draft"], flush=True)
        for name, path in drafts.items():
            for k in ("3", "auto"):
                report["run"][f"{name} -k {k}"] = r = check_run(model, texts, ref, args, [path, "-k", k])
                print(f"run {name} -k {k}", r, flush=True)
    for name, path in drafts.items():
        if "api" not in skip:
            report["api"][name] = check_api(model, Path(path), texts, ref, args)
            print(f"api {name}", report["api"][name], flush=True)
        if "bench" not in skip:
            report["bench"][name] = check_bench(model, Path(path), texts, ref, args)
            print(f"bench {name}", report["bench"][name], flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    lossless = all(v["equal"] == v["of"] for v in report["run"].values()) and all(
        v["equal"] == v["of"] for d in report["api"].values() for v in d.values()) and all(
        all(d[m]["equal_to_raw"] == d[m]["of"] for m in ("raw", "chain", "auto")) and d["raw_equal_to_oracle"] == len(texts)
        for d in report["bench"].values())
    print(("LOSSLESS" if lossless else "DIVERGED") + f" in {report['wall_s']} s")
    sys.exit(0 if lossless else 1)


if __name__ == "__main__":
    main()
