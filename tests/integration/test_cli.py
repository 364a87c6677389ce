"""The command line on the real GGUF: it runs, and every user mistake is one clear line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hetero_spec.config import DraftConfig
from hetero_spec.draft.checkpoint import load_draft, read_config, save_draft
from hetero_spec.draft.model import DraftModel, init_weights

CLI = [sys.executable, "-m", "hetero_spec"]
PROMPT = "List three colours."


def hetero(*args: str, timeout: float = 180, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, input=stdin)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_run_with_draft_matches_no_draft(model_path, random_draft_path, tmp_path):
    stats = tmp_path / "stats.json"
    spec = hetero("run", model_path, random_draft_path, "-p", PROMPT, "-n", "40", "-k", "3", "--stats-json", stats)
    plain = hetero("run", model_path, "--no-draft", "-p", PROMPT, "-n", "40")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout.strip()) > 10
    assert "tok/s" in spec.stderr and "mean accepted length" in spec.stderr
    record = json.loads(stats.read_text())
    assert record["new_tokens"] <= 40 and record["rounds"] >= 1 and record["bytes_to_draft"] > 0


def test_interactive_session_keeps_history(model_path, random_draft_path):
    proc = hetero("run", model_path, random_draft_path, "-n", "12", stdin="Hi there\nAnd again\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("mean accepted length") == 2


def test_stop_string(model_path):
    args = ("run", model_path, "--no-draft", "-p", "Describe the sea in two sentences.", "-n", "60")
    full = hetero(*args).stdout
    words = full.split()
    assert len(words) > 6
    stop = " " + words[4]  # a stop string that the unconstrained output certainly contains
    cut = hetero(*args, "--stop", stop)
    assert cut.returncode == 0 and "stop_string" in cut.stderr
    assert cut.stdout.rstrip("\n") == full[: full.index(stop)]


def test_missing_and_non_gguf_model(tmp_path, random_draft_path):
    assert_one_line_error(hetero("run", tmp_path / "nope.gguf", random_draft_path, "-p", "x"), "not found")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert_one_line_error(hetero("run", text, random_draft_path, "-p", "x"), "not a GGUF")


def test_truncated_gguf(tmp_path, model_path, random_draft_path):
    cut = tmp_path / "cut.gguf"
    with open(model_path, "rb") as src:
        cut.write_bytes(src.read(3_000_000))
    assert_one_line_error(hetero("run", cut, random_draft_path, "-p", "x"), "could not load")


def test_draft_for_another_model(tmp_path, model_path, random_draft_path):
    small = DraftConfig(n_embd=64, n_vocab=49152, hidden_size=64, n_heads=4, n_kv_heads=2, ffn_size=128)
    save_draft(init_weights(DraftModel(small)), tmp_path / "small.safetensors")
    assert_one_line_error(hetero("run", model_path, tmp_path / "small.safetensors", "-p", "x"), "64", "576")
    cfg = read_config(random_draft_path)
    other = replace(cfg, fingerprint=replace(cfg.fingerprint, tokenizer_sha256="0" * 64))
    m = load_draft(random_draft_path)
    m.cfg = other
    save_draft(m, tmp_path / "other.safetensors")
    assert_one_line_error(hetero("run", model_path, tmp_path / "other.safetensors", "-p", "x"), "tokenizer_sha256")


def test_truncated_draft(tmp_path, model_path, random_draft_path):
    data = Path(random_draft_path).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 3])
    assert_one_line_error(hetero("run", model_path, tmp_path / "cut.safetensors", "-p", "x"))


def test_empty_and_too_long_prompt(model_path, random_draft_path):
    assert_one_line_error(hetero("run", model_path, random_draft_path, "-p", "  "), "empty prompt")
    long = "word " * 400
    assert_one_line_error(hetero("run", model_path, random_draft_path, "--ctx", "128", "-p", long), "context")


def test_bad_options_are_one_line(model_path, random_draft_path, tmp_path):
    proc = hetero("run", model_path, random_draft_path, "-p", "x", "--draft-device", "cuda:7")
    assert_one_line_error(proc, "cuda:7") if "torch sees no CUDA" in proc.stderr or "does not exist" in proc.stderr \
        else pytest.fail(proc.stderr)
    (tmp_path / "cache.json").write_text("[1, 2]")
    assert_one_line_error(hetero("run", model_path, "-p", "x", "--suffix-cache", tmp_path / "cache.json"),
                          "not a readable suffix cache")


def test_impossible_options_fail_before_anything_loads(model_path):
    """More threads than CPUs (1,000 on 2 CPUs ran a minute without a token or a word), a NaN or infinite
    temperature (NaN failed mid-run in the sampler), a seed below -1 (failed in numpy): refused at once."""
    cases = [(("-t", (os.cpu_count() or 1) + 1), "0<=x<="), (("--temperature", "nan"), "finite number"),
             (("--temperature", "inf"), "finite number"), (("--seed", "-2"), "x>=-1")]
    for args, fragment in cases:
        proc = hetero("run", model_path, "-p", "x", *args, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and fragment in proc.stderr, (args, proc.stderr)


def test_non_finite_numbers_are_refused_by_every_command(model_path, tmp_path):
    """click's float ranges let nan through (nan < 0 is false): ``train --lr nan`` trained the whole budget into a
    draft of NaNs, ``serve --queue-timeout inf`` never answered a queued request with its 503."""
    feats = tmp_path / "features"
    feats.mkdir()
    train = ("train", feats, "--target", model_path, "--out", tmp_path / "d.safetensors")
    cases = [(*train, "--lr"), (*train, "--noise"), (*train, "--time-budget"),
             ("export-features", model_path, tmp_path / "f", "--temperature"),
             ("make-prompts", model_path, tmp_path / "p.jsonl", "--top-p"),
             ("serve", model_path, "--queue-timeout"), ("run", model_path, "-p", "x", "--top-p")]
    for *args, option in cases:
        for value in ("nan", "inf"):
            proc = hetero(*args, option, value, timeout=60)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, option, proc.stderr)
            said = re.search(rf"Invalid value for '{option}': '?{value}'? is not (a finite number|in the range)",
                             proc.stderr)
            assert said and (value == "inf" or said.group(1) == "a finite number"), proc.stderr
    assert not (tmp_path / "d.safetensors").exists() and not (tmp_path / "f").exists()


def test_seed_minus_one_samples_and_stats_json_makes_its_folder(model_path, tmp_path):
    """-1 is a fresh seed, as in llama.cpp and the server; --stats-json into a folder that does not exist yet
    wrote nothing and failed with a traceback after the whole run."""
    stats = tmp_path / "new" / "folder" / "stats.json"
    proc = hetero("run", model_path, "-p", PROMPT, "-n", "4", "--temperature", "1", "--seed", "-1",
                  "--stats-json", stats)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^seed \d+$", proc.stderr, re.M), proc.stderr  # said, so the run can be repeated
    assert json.loads(stats.read_text())["new_tokens"] >= 1


def test_the_command_line_answers_without_loading_torch_or_llama_cpp():
    """``hetero-spec --help`` and a mistyped option need neither: the package's names load on first use, so
    they answer at once and a Ctrl-C during start-up is one line, not an import traceback."""
    code = "import sys, hetero_spec.cli; loaded = {'torch', 'llama_cpp'} & set(sys.modules); assert not loaded, loaded"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert hetero("--help", timeout=60).returncode == 0


def test_ctrl_c_stops_cleanly_with_partial_stats(model_path, random_draft_path):
    # a shell that starts the test run with ``&`` leaves SIGINT ignored, and children inherit that; a
    # terminal's Ctrl-C reaches a process whose SIGINT is at its default
    proc = subprocess.Popen([*CLI, "run", str(model_path), str(random_draft_path), "-p", "Write a long story.",
                             "-n", "2000", "--ctx", "4096"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(20)  # generation has started once text arrives
    assert first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "interrupted" in err and "tok/s" in err


def test_embedding_model_is_not_a_target(tmp_path, model_path, random_draft_path):
    from tests.tiny_gguf import write_tiny_llama

    decoder = write_tiny_llama(model_path, tmp_path / "tiny.gguf")
    ok = hetero("run", decoder, "--no-draft", "-p", "hello", "-n", "4")
    assert ok.returncode == 0, ok.stderr  # the builder makes loadable models
    pooled = write_tiny_llama(model_path, tmp_path / "embedder.gguf", extra={"llama.pooling_type": 1})
    assert_one_line_error(hetero("run", pooled, "--no-draft", "-p", "hello"), "not a decoder-only language model")
