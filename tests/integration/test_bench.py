"""The bench end to end on the real GGUF: tiny runs, structure and output equality asserted (never speed)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hetero_spec.bench.baselines import BenchTarget
from hetero_spec.bench.harness import METHODS, BenchConfig, Method, load_dataset, register, run_bench
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.bench.report import markdown, summarize, write_bench
from hetero_spec.errors import HeteroSpecError
from hetero_spec.target.llama_target import default_threads
from tests.curves import cheap_rows_cached

CLI = [sys.executable, "-m", "hetero_spec"]
METHOD_NAMES = ("raw", "llama-cpp", "prompt-lookup", "plain", "chain", "chain-k1", "tree", "auto")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def custom_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text(json.dumps({"turns": ["Name three primes and say why they are prime.", "More?"]}) + "\n\n")
    return path


@pytest.fixture(scope="module")
def result(model_path, random_draft_path, custom_jsonl):
    cfg = BenchConfig(
        target=BenchTarget(model_path, random_draft_path, threads=default_threads(), n_ctx=512, k=3),
        datasets=("mt_bench", str(custom_jsonl)), methods=METHOD_NAMES, n_prompts=1, max_new_tokens=16,
    )
    seen = []
    # auto on a curve that prices rows nearly free (the measuring itself: tests/integration/test_calibration.py):
    # it drafts whatever this machine's t(n), so its lossless check covers drafted rounds
    with cheap_rows_cached(model_path, default_threads(), random_draft_path):
        res = run_bench(cfg, progress=seen.append)
    assert sorted(seen) == sorted(METHOD_NAMES * 2)  # one progress tick per method and prompt
    return res


def test_every_method_ran_on_every_prompt(result):
    pairs = {(r.method, r.dataset) for r in result.records}
    assert pairs == {(m, d) for m in METHOD_NAMES for d in ("mt_bench", "mine")}
    for r in result.records:
        assert 1 <= r.new_tokens <= 16 and r.wall_s > 0 and r.tokens_per_s > 0 and r.text
    raw = [r for r in result.records if r.method == "raw"]
    assert all(r.speedup == 1.0 and r.equal for r in raw)


def test_hetero_spec_and_high_level_api_match_raw(result):
    """Lossless greedy speculation, and the same kernels on every path (flash attention aligned)."""
    for r in result.records:
        if r.method in ("plain", "chain", "chain-k1", "tree", "auto", "llama-cpp"):
            texts = {o.method: o.text for o in result.records if o.dataset == r.dataset}
            assert r.equal, f"{r.method} differs from raw on {r.dataset}: {texts}"
        if r.equal and r.method != "raw":
            assert "raw" in r.same_text_as


def test_speculative_records_carry_rounds_and_split(result):
    for r in (r for r in result.records if r.method in ("chain", "chain-k1", "tree")):
        bound = {"chain": 3, "chain-k1": 1}.get(r.method, 6)  # k, or the tree depth
        assert r.stats["rounds"] >= 1 and r.accepted and all(0 <= a <= bound for a in r.accepted)
        assert r.stats["bytes_to_draft"] > 0 and r.prefill_s is not None and 0 < r.prefill_s < r.wall_s
    rows = {(s["method"], s["dataset"]): s for s in summarize(result)}
    chain = rows[("chain", "all")]
    assert chain["prompts"] == 2 and chain["equal"] == 2
    assert 1.0 <= chain["mean_accepted_length"] <= 4.0
    assert set(chain["split"]) == {"prefill", "verify", "draft", "overhead", "other"}
    assert abs(sum(chain["split"].values()) - 1.0) < 1e-6 and chain["bytes_per_token"] > 0
    assert rows[("llama-cpp", "all")]["mean_accepted_length"] is None


def test_report_files(result, tmp_path):
    paths = write_bench(result, tmp_path / "out")
    names = {p.name for p in paths}
    assert names == {"bench.json", "bench.md", "speedup.png", "accepted_length.png"}
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["meta"]["target_label"] == "real model" and data["meta"]["draft"]
    assert data["meta"]["tree"] == {"total_tokens": 12, "depth": 6, "top_k": 2}
    assert len(data["prompts"]) == 2 * len(METHOD_NAMES) and {s["method"] for s in data["summary"]} == set(METHOD_NAMES)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert md == markdown(result)
    assert all(md.count(f"| chain | {d} |") == 1 for d in ("mt_bench", "mine", "all"))
    assert "Identical text, method against method" in md


def test_registry_takes_a_new_method_in_one_entry(model_path, random_draft_path):
    register(Method("chain-k1", "chain with one draft", lambda c: c.hetero_run(draft_len=1),
                    needs_draft=True, speculative=True))
    try:
        cfg = BenchConfig(target=BenchTarget(model_path, random_draft_path, threads=default_threads(), n_ctx=512),
                          datasets=("gsm8k",), methods=("chain-k1",), n_prompts=1, max_new_tokens=8, warmup=False)
        res = run_bench(cfg)
        assert {r.method for r in res.records} == {"raw", "chain-k1"}  # raw always runs: the baseline
        assert all(r.equal for r in res.records)
        assert all(a <= 1 for r in res.records for a in r.accepted)
    finally:
        METHODS.pop("chain-k1")


def test_tree_shapes_are_methods_by_name(model_path, random_draft_path):
    """tree-t{tokens}-d{depth}-k{top_k}: one run compares tree shapes, each drafted as its name says and
    lossless against raw."""
    cfg = BenchConfig(target=BenchTarget(model_path, random_draft_path, threads=default_threads(), n_ctx=512),
                      datasets=("gsm8k",), methods=("tree-t2-d2-k2", "tree-t5-d3-k2"), n_prompts=1,
                      max_new_tokens=12, warmup=False)
    res = run_bench(cfg)
    assert {r.method for r in res.records} == {"raw", "tree-t2-d2-k2", "tree-t5-d3-k2"}
    assert all(r.equal for r in res.records)
    drafted = {r.method: max(row[0] for row in r.rounds) for r in res.records if r.method != "raw"}
    assert drafted == {"tree-t2-d2-k2": 2, "tree-t5-d3-k2": 5}
    assert "depth 3, top-k 2" in res.meta["methods"]["tree-t5-d3-k2"]


def test_repeats_run_in_mirrored_order_and_keep_each_methods_fastest_run(model_path):
    """--repeats 2: two passes, each prompt A B in one and B A in the other; a run slowed by a (here
    injected) noisy spell is dropped."""
    calls: list[str] = []

    class Recorded:
        def __init__(self, inner, name: str) -> None:
            self.inner, self.name = inner, name

        def run(self, prompt, max_new_tokens):
            calls.append(self.name)
            r = self.inner.run(prompt, max_new_tokens)
            first = calls.count(self.name) == 1 and self.name == "slowed"
            return replace(r, wall_s=r.wall_s + 5.0) if first else r

        def close(self):
            pass

    raw = METHODS["raw"]
    register(Method("raw", raw.description, lambda c: Recorded(raw.build(c), "raw")))
    register(Method("slowed", "raw, its first run in the bench 5 s slower",
                    lambda c: Recorded(raw.build(c), "slowed")))
    try:
        cfg = BenchConfig(target=BenchTarget(model_path, None, threads=default_threads(), n_ctx=512),
                          datasets=("gsm8k",), methods=("raw", "slowed"), n_prompts=2, max_new_tokens=6,
                          warmup=False, repeats=2)
        ticks = []
        res = run_bench(cfg, progress=ticks.append)
    finally:
        METHODS.pop("slowed")
        register(raw)
    assert len(ticks) == 8 and res.meta["repeats"] == 2 and "fastest of 2 runs" in res.meta["timing"]
    assert calls == ["raw", "slowed", "slowed", "raw",  # pass 1: prompt 1 A B, prompt 2 the other first
                     "slowed", "raw", "raw", "slowed"]  # pass 2: mirrored, so each prompt's order flips
    slowed = [r for r in res.records if r.method == "slowed"]
    assert len(slowed) == 2 and all(r.equal for r in slowed) and all(r.wall_s < 5.0 for r in slowed)


def test_dataset_loading(custom_jsonl, tmp_path):
    assert load_dataset("gsm8k", 3).prompts == tuple(bench_prompts("gsm8k", 3))
    assert load_dataset(str(custom_jsonl), 5).prompts == ("Name three primes and say why they are prime.",)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(HeteroSpecError, match="turns"):
        load_dataset(str(bad), 1)
    with pytest.raises(HeteroSpecError, match="unknown dataset"):
        load_dataset("no_such_set", 1)


def test_cli_bench_writes_report(model_path, random_draft_path, tmp_path):
    proc = subprocess.run([*CLI, "bench", model_path, random_draft_path, "--datasets", "alpaca", "--n-prompts", "1",
                           "--max-new-tokens", "8", "--methods", "raw,chain", "--ctx", "512", "--out", tmp_path,
                           "--project", "laptop-7b-q4_0", "--project", "this-run"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "| chain | alpaca |" in proc.stdout and "bench:" in proc.stderr  # table, progress bar
    assert "PROJECTIONS, not measurements" in proc.stdout and "| laptop-7b-q4_0 | chain | alpaca |" in proc.stdout
    assert "| this-run | chain | alpaca |" in proc.stdout
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "speedup.png").is_file()
    data = json.loads((tmp_path / "bench.json").read_text())
    chain = next(p for p in data["prompts"] if p["method"] == "chain")
    assert chain["rounds"] and len(chain["rounds"][0]) == len(data["meta"]["round_fields"])
    assert sum(r[2] for r in chain["rounds"]) == chain["new_tokens"] - 1  # rounds emit all but the prefill's token
    assert data["projections"] and all("PROJECTION" in r["label"] for r in data["projections"])
    cal = data["meta"]["calibration"]  # one pass after the one prompt, with the draft's step and switch
    assert cal["passes"] == 1 and cal["curve"]["draft_step_ms"] > 0 and "draft_switch_ms" in cal["curve"]
    mine = next(r for r in data["projections"] if r["curve"] == "this-run" and r["dataset"] == "alpaca")
    assert mine["curve_t1_ms"] == pytest.approx(cal["curve"]["verify_ms"]["1"])


@pytest.mark.parametrize("args, fragment", [
    (["--methods", "raw,warp-drive"], "unknown method"),
    (["--datasets", "nope"], "unknown dataset"),
    (["--project", "nope"], "no cost curve"),
    (["--methods", "raw,tree-t40-d2-k2"], "tree tokens must be in 1..31"),
])
def test_cli_bench_user_errors_are_one_line(model_path, random_draft_path, args, fragment):
    proc = subprocess.run([*CLI, "bench", model_path, random_draft_path, *args], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(lines) == 1 and fragment in lines[0]


def test_cli_bench_chain_needs_a_draft(model_path):
    proc = subprocess.run([*CLI, "bench", model_path, "--methods", "chain"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "needs a DRAFT" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------ llama.cpp's own speculation
def test_llama_methods_that_cannot_run_are_reported_with_their_reason(model_path, tmp_path, monkeypatch):
    from hetero_spec.bench.llama_server import BIN_ENV

    monkeypatch.setenv(BIN_ENV, str(tmp_path))  # no build here
    cfg = BenchConfig(target=BenchTarget(model_path, None, threads=1, n_ctx=512),
                      datasets=("gsm8k",), methods=("raw", "llama.cpp-ngram", "llama.cpp-eagle3"), n_prompts=1,
                      max_new_tokens=4, warmup=False)
    res = run_bench(cfg)
    assert {r.method for r in res.records} == {"raw"}
    assert "build_llama_cpp.sh" in res.meta["not_run"]["llama.cpp-ngram"]
    assert res.meta["not_run"]["llama.cpp-eagle3"] == "no --eagle3-gguf given"
    md = markdown(res)
    assert "Not run:" in md and "- `llama.cpp-eagle3`: no --eagle3-gguf given" in md


def _llama_server_built() -> bool:
    from hetero_spec.bench.llama_server import SERVER, tools_dir

    return (tools_dir() / SERVER).is_file()


@pytest.mark.skipif(not _llama_server_built(), reason="llama-server not built: run bash scripts/build_llama_cpp.sh "
                                                       "(several minutes; the suite never builds it)")
def test_llama_cpp_methods_are_lossless_against_raw(model_path):
    """llama-server plain (method llama-server), n-gram and draft-model speculation (the target as its own draft: a sanity
    check that drafts flow and are accepted), token ids compared with raw; a GGUF that is not an
    EAGLE-3 draft makes llama.cpp-eagle3 unavailable with the server's own reason."""
    cfg = BenchConfig(target=BenchTarget(model_path, None, threads=1, n_ctx=1024, k=3, llama_draft_model=model_path,
                                         eagle3_gguf=model_path),
                      datasets=("humaneval",), methods=("llama-server", "llama.cpp-ngram", "llama.cpp-draft",
                                                        "llama.cpp-eagle3"),
                      n_prompts=2, max_new_tokens=32, warmup=False)
    res = run_bench(cfg)
    assert "not eagle3" in res.meta["not_run"]["llama.cpp-eagle3"]  # the server's own reason, not a silent fallback
    texts = {}
    for r in res.records:
        texts.setdefault(r.index, {})[r.method] = r.text
        assert r.compared_by == "tokens" and r.equal, f"{r.method} differs from raw: {texts[r.index]}"
        if r.method.startswith(("llama.cpp", "llama-server")):
            assert r.engine["predicted_n"] == r.new_tokens and 0 < r.prefill_s < r.wall_s
    drafted = [r.engine for r in res.records if r.method == "llama.cpp-draft"]
    assert sum(e["drafted"] for e in drafted) > 0
    assert sum(e["accepted"] for e in drafted) >= 0.8 * sum(e["drafted"] for e in drafted)
    rows = {(s["method"], s["dataset"]): s for s in summarize(res)}
    assert rows[("llama.cpp-draft", "all")]["mean_accepted_length"] > 1.5
    assert rows[("llama-server", "all")]["mean_accepted_length"] is None  # no drafting, no accepted length
