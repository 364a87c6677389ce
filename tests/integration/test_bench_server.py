"""``hetero-spec bench server``: the real server on loopback against the real ``run`` CLI, on the default GGUF."""
from __future__ import annotations

import json
import subprocess
import sys

CLI = [sys.executable, "-m", "hetero_spec"]


def test_bench_server_measures_the_server_against_run_under_load_and_across_turns(model_path, tmp_path):
    """Small figures, but each part runs for real: greedy texts through the server equal run's, every client's
    request is answered, and a conversation's second turn is timed warm and cold."""
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [*CLI, "bench", "server", str(model_path), "-t", "1", "--ctx", "1024", "--parts", "overhead,load,turns",
         "--n-prompts", "2", "--repeats", "1", "--max-tokens", "8", "--clients", "2", "--per-client", "2",
         "--load-tokens", "8", "--conversations", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    o = r["overhead"]
    assert len(o["rows"]) == 2 and o["all_texts_equal"] is True
    assert all(row["tokens"] > 0 and row["run_decode_tps"] > 0 and row["server_decode_tps"] > 0 for row in o["rows"])
    assert r["load"]["requests"] == 4 and r["load"]["aggregate_tps"] > 0
    assert all(len(texts) == 1 for texts in r["load"]["texts"].values())  # greedy: one text per prompt, whoever asked
    assert r["turns"]["conversations"] == 1 and r["turns"]["warm_ttft_s"]["n"] == 1
    assert "1 client over 2 interleaved runs" in proc.stdout


def test_bench_server_interleaved_conversations_with_and_without_the_prompt_cache(model_path, tmp_path):
    """Twice as many conversations as slots: with the prompt cache the second turns get their cells back from
    host memory, without it none do, and the texts are the same either way."""
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [*CLI, "bench", "server", str(model_path), "-t", "1", "--ctx", "1024", "--parts", "interleaved",
         "--parallel", "2", "--max-tokens", "8", "--conversations", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    iv = json.loads(out.read_text())["interleaved"]
    assert iv["parallel"] == 2 and iv["conversations"] == 4 and iv["texts_equal"] is True
    assert iv["cache"]["restored_prompt_tokens"] > 0 and iv["no_cache"]["restored_prompt_tokens"] == 0
    assert iv["cache"]["ttft_s"]["n"] == iv["no_cache"]["ttft_s"]["n"] == 4
    assert "4 conversations through 2 slots" in proc.stdout


def test_bench_server_refuses_unknown_parts_in_one_line(model_path):
    proc = subprocess.run([*CLI, "bench", "server", str(model_path), "--parts", "overhead,speed"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "choose from overhead, load, batched, turns" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_keeps_model_first_and_names_its_subcommands(model_path, tmp_path):
    """``bench MODEL`` is still the speed benchmark (its own option errors show), ``bench --help`` lists the rest."""
    listed = subprocess.run([*CLI, "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    for name in ("curve", "project", "server", "speed", "training"):
        assert f"\n  {name} " in listed.stdout
    bad = subprocess.run([*CLI, "bench", str(model_path), "--methods", ""], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--datasets and --methods need at least one entry each" in bad.stderr
    missing = subprocess.run([*CLI, "bench", "project", str(tmp_path / "none.json")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_bench_help_and_other_subcommands_need_no_httpx(model_path):
    """Without the [server] extra's httpx, ``bench --help`` still lists every subcommand, and ``bench server``
    says in one line what to install."""
    no_httpx = "import sys; sys.modules['httpx'] = None; from hetero_spec.cli import main; sys.argv[0] = 'hetero-spec'; main()"
    listed = subprocess.run([sys.executable, "-c", no_httpx, "bench", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0 and "\n  server " in listed.stdout, listed.stderr
    refused = subprocess.run([sys.executable, "-c", no_httpx, "bench", "server", str(model_path)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "bench server needs httpx" in refused.stderr
    assert "Traceback" not in refused.stderr
