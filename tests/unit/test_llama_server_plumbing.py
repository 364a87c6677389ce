"""The llama.cpp bench methods' plumbing, without a built llama-server: commands, requests, answers, reasons."""
from __future__ import annotations

from pathlib import Path

import pytest

from hetero_spec.bench.baselines import BenchTarget
from hetero_spec.bench.harness import LLAMA_DRAFT, LLAMA_EAGLE3, LLAMA_NGRAM, METHODS
from hetero_spec.bench.llama_server import (BIN_ENV, MethodUnavailable, completion_request, find_tool, run_result,
                                            server_command, spec_args, tools_dir)


@pytest.fixture()
def target(tmp_path) -> BenchTarget:
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    return BenchTarget(model, None, threads=3, n_ctx=1024, k=4, kv_type="q8_0")


def _after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_server_command_shares_the_raw_baselines_settings(target):
    cmd = server_command(Path("/bin/llama-server"), target, "q8_0", 4321, ["--spec-type", "ngram-simple"])
    assert cmd[0] == "/bin/llama-server" and _after(cmd, "-m") == str(target.model)
    assert _after(cmd, "-t") == _after(cmd, "-tb") == "3"
    assert _after(cmd, "-ctk") == _after(cmd, "-ctv") == "q8_0"
    assert _after(cmd, "-ub") == "32"  # the batch-invariant micro-batch
    assert int(_after(cmd, "-b")) >= 49  # one logical batch holds ngram-simple's 48 drafts + the sampled token
    assert _after(cmd, "-fa") == "auto" and _after(cmd, "-np") == "1" and _after(cmd, "-c") == "1024"
    assert _after(cmd, "--port") == "4321" and _after(cmd, "--host") == "127.0.0.1"
    assert "--metrics" in cmd and "--no-cache-prompt" in cmd and cmd[-2:] == ["--spec-type", "ngram-simple"]


def test_user_arguments_come_last_so_they_override(target):
    from dataclasses import replace

    t = replace(target, llama_args=("--spec-ngram-simple-size-n", "4"))
    assert server_command(Path("s"), t, "f16", 1, [])[-2:] == ["--spec-ngram-simple-size-n", "4"]


def test_draft_methods_need_their_file_and_say_so(target, tmp_path):
    with pytest.raises(MethodUnavailable, match="no --eagle3-gguf given"):
        spec_args(LLAMA_EAGLE3, target)
    with pytest.raises(MethodUnavailable, match="no --llama-draft-model given"):
        spec_args(LLAMA_DRAFT, target)
    from dataclasses import replace

    missing = replace(target, eagle3_gguf=tmp_path / "nope.gguf")
    with pytest.raises(MethodUnavailable, match="does not exist"):
        spec_args(LLAMA_EAGLE3, missing)
    eagle = tmp_path / "eagle3.gguf"
    eagle.write_bytes(b"GGUF")
    args = spec_args(LLAMA_EAGLE3, replace(target, eagle3_gguf=eagle))
    assert args[:2] == ["--spec-type", "draft-eagle3"] and _after(args, "-md") == str(eagle)
    assert _after(args, "--spec-draft-n-max") == "4" and _after(args, "-td") == "3"  # k and threads of the bench
    assert spec_args(LLAMA_NGRAM, target) == ["--spec-type", "ngram-simple"]


def test_missing_build_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    assert tools_dir() == tmp_path
    with pytest.raises(MethodUnavailable, match="build_llama_cpp.sh"):
        find_tool("llama-server")


def test_default_tools_dir_is_the_build_scripts_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(BIN_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tools_dir() == tmp_path / "hetero-spec" / "llama.cpp-0.3.36" / "bin"
    script = (Path(__file__).resolve().parents[2] / "scripts" / "build_llama_cpp.sh").read_text()
    assert 'VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"' in script
    assert 'hetero-spec/llama.cpp-${VERSION}' in script and "-j" in script


def test_completion_request_is_greedy_ids_in_ids_out():
    req = completion_request([1, 2, 3], 16)
    assert req["prompt"] == [1, 2, 3] and req["n_predict"] == 16
    assert req["temperature"] == 0.0 and req["repeat_penalty"] == 1.0 and req["dry_multiplier"] == 0.0
    assert req["return_tokens"] is True and req["cache_prompt"] is False and req["stream"] is False


def test_run_result_uses_the_servers_own_timing():
    out = {"tokens": [5, 6, 7, 2], "stop_type": "eos",
           "timings": {"prompt_n": 30, "prompt_ms": 200.0, "predicted_n": 4, "predicted_ms": 30.0}}
    drafts = {"spec_decode_num_draft_tokens_total": 6.0, "spec_decode_num_accepted_tokens_total": 2.0,
              "spec_decode_num_drafts_total": 2.0}
    r = run_result(out, 0.25, drafts, lambda ids: " ".join(map(str, ids[:-1])))
    assert r.tokens == [5, 6, 7, 2] and r.new_tokens == 4 and r.text == "5 6 7"
    assert r.prefill_s == pytest.approx(0.2) and r.wall_s == pytest.approx(0.23)
    # the harness's decode speed, (n - 1) / (wall - prefill), is the server's predicted_per_second
    assert (r.new_tokens - 1) / (r.wall_s - r.prefill_s) == pytest.approx(3 / 0.030)
    assert r.engine["client_wall_s"] == 0.25 and (r.engine["accepted"], r.engine["verify_steps"]) == (2, 2)


def test_run_result_refuses_inconsistent_answers():
    out = {"tokens": [5], "timings": {"prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 2, "predicted_ms": 1.0}}
    with pytest.raises(Exception, match="returned 1 ids for 2"):
        run_result(out, 0.1, {}, str)


def test_llama_methods_are_registered_without_needing_a_torch_draft():
    for name in ("llama-server", "llama.cpp-ngram", "llama.cpp-draft", "llama.cpp-eagle3"):
        assert name in METHODS and not METHODS[name].needs_draft


def test_batched_figures_pair_each_pass_with_the_peer_of_its_mode():
    """Ours against llama-server's same mode, else its best n-gram mode; the per-pass ratio pairs the passes (which
    share the host's spell) and is left out where a pass failed on either side."""
    from hetero_spec.bench.server_load import paired_ratio, peer_of

    def cfg(server, spec, passes, errors=()):
        return {"server": server, "spec": spec, "aggregate_tps": sorted(passes)[len(passes) // 2],
                "aggregate_tps_passes": passes, "errors": list(errors)}

    off, llama_off = cfg("hetero-spec", "off", [100.0, 90.0, 80.0]), cfg("llama-server", "off", [50.0, 100.0, 40.0])
    on = cfg("hetero-spec", "on", [260.0, 200.0, 215.0])
    simple, mod = cfg("llama-server", "ngram-simple", [300.0, 300.0, 300.0]), cfg("llama-server", "ngram-mod",
                                                                                   [230.0, 250.0, 215.0])
    configs = [off, llama_off, on, simple, mod]
    assert peer_of(off, configs) is llama_off and peer_of(on, configs) is simple and peer_of(llama_off, configs) is None
    assert paired_ratio(off, llama_off) == pytest.approx(2.0)  # passes 2.0, 0.9, 2.0; the medians' ratio is 1.8
    assert paired_ratio(on, mod) == pytest.approx(1.0)  # 1.13, 0.8, 1.0
    failed = cfg("llama-server", "ngram-mod", [230.0, 250.0], errors=["ReadTimeout"])
    assert paired_ratio(on, failed) is None
