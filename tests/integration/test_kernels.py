"""The kernel plan (``target/kernels.py``): every mode is forced and exercised on every machine, in
child processes, so a machine whose AMX tiles fault (the first decode dies in
``ggml_backend_amx_mul_mat``) cannot take the test run down with it."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hetero_spec.target import kernels
from hetero_spec.target.kernels import KernelPlan, ProbeResult, decide, run_probe

CLI = [sys.executable, "-m", "hetero_spec"]


def _has_flag(flag: str) -> bool:
    return flag in kernels.cpu_info()[1]


# ------------------------------------------------------------------ the decision, from the probe's answer
@pytest.fixture
def amx_cpu(monkeypatch, tmp_path):
    """A CPU that reports AMX, with the probe cache in a folder of its own."""
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_info", lambda: ("Test Xeon", {"avx2", "amx_tile", "amx_int8"}))
    monkeypatch.setattr(kernels.sys, "platform", "linux")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    calls: list[str] = []
    return calls


def _answer(monkeypatch, calls: list[str], result: ProbeResult) -> None:
    def probe(mode: str = "default", timeout_s: float = 0.0) -> ProbeResult:
        calls.append(mode)
        return result

    monkeypatch.setattr(kernels, "run_probe", probe)


def test_faulting_tiles_deny_amx_and_the_answer_is_cached(amx_cpu, monkeypatch):
    _answer(monkeypatch, amx_cpu, ProbeResult(False, (), "killed by signal 11"))
    plan = decide()
    assert plan.mode == "no-amx" and "signal 11" in plan.reason
    assert plan.extra_bufts and plan.tool_args() == []  # repack kept; the tools inherit the filter
    assert decide().mode == "no-amx"
    assert amx_cpu == ["default"]  # probed once, then read from the cache


def test_working_tiles_keep_llama_cpp_s_choice(amx_cpu, monkeypatch):
    _answer(monkeypatch, amx_cpu, ProbeResult(True, ("AMX", "CPU_Mapped"), ""))
    assert decide() == KernelPlan("default", "AMX tiles work here")


def test_no_amx_flag_means_no_probe(amx_cpu, monkeypatch):
    monkeypatch.setattr(kernels, "cpu_info", lambda: ("Test EPYC", {"avx2", "avx512f"}))
    _answer(monkeypatch, amx_cpu, ProbeResult(False, (), "must not be asked"))
    assert decide().mode == "default" and amx_cpu == []


def test_forced_modes_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "plain")
    plan = decide()
    assert plan.mode == "plain" and not plan.extra_bufts and plan.tool_args() == ["--no-repack"]
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(Exception, match="HETERO_SPEC_KERNELS='fast'"):
        decide()


# ------------------------------------------------------------------ the modes, for real, in children
def test_the_probe_survives_under_this_machine_s_plan():
    """What every model load in this process runs under: the probe decodes 32 rows and 1 row and lives."""
    plan = decide()
    result = run_probe(plan.mode)
    assert result.survived, result.detail
    if plan.mode == "no-amx":
        assert "AMX" not in result.buffer_types
    if _has_flag("avx2"):  # llama.cpp repacks Q4_0 with 8-row-aligned matrices for AVX2 and up
        assert "CPU_REPACK" in result.buffer_types or "AMX" in result.buffer_types


def test_plain_mode_turns_the_extra_buffer_types_off():
    result = run_probe("plain")
    assert result.survived, result.detail
    assert set(result.buffer_types) <= {"CPU", "CPU_Mapped"}


def test_no_amx_mode_denies_the_tile_permission_to_the_process_and_its_children():
    """The seccomp rule makes arch_prctl(ARCH_REQ_XCOMP_PERM) fail with EPERM here and in a child
    (what llama-server started by the bench inherits), and llama.cpp still repacks."""
    code = textwrap.dedent("""
        import json, subprocess, sys
        from hetero_spec.target.kernels import apply_kernel_plan, cpu_extra_buffer_types, request_amx_permission
        plan = apply_kernel_plan()
        bufts = cpu_extra_buffer_types()
        child = subprocess.run([sys.executable, "-c",
                                "from hetero_spec.target.kernels import request_amx_permission as r; print(r())"],
                               capture_output=True, text=True, check=True)
        print(json.dumps({"mode": plan.mode, "here": request_amx_permission(), "child": int(child.stdout),
                          "bufts": bufts}))
    """)
    env = dict(os.environ, **{kernels.ENV: "no-amx"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    bufts = answer.pop("bufts")
    assert answer == {"mode": "no-amx", "here": errno.EPERM, "child": errno.EPERM}
    assert "AMX" not in bufts and "AMX is not ready" not in proc.stderr  # llama.cpp's notice is swallowed
    result = run_probe("no-amx")
    assert result.survived and "AMX" not in result.buffer_types
    if _has_flag("avx2"):
        assert "CPU_REPACK" in result.buffer_types


@pytest.mark.parametrize("mode", ["plain", "auto"])
def test_the_real_model_runs_lossless_under_each_plan(mode, model_path, random_draft_path, tmp_path):
    """The default model through ``run`` in a child process (on an AMX VM, ``auto`` is what keeps it
    alive): it reports its kernels in ``--verbose`` and the stats, and a k=3 chain equals plain decoding."""
    env = dict(os.environ, **{kernels.ENV: mode})
    outs = {}
    for name, extra in (("spec", [str(random_draft_path), "-k", "3"]), ("plain", ["--no-draft"])):
        stats = tmp_path / f"{name}.json"
        proc = subprocess.run([*CLI, "run", str(model_path), *extra, "--raw", "-p", "The capital of France is",
                               "-n", "24", "-t", "1", "--draft-device", "cpu", "-v", "--stats-json", str(stats)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = next(x for x in proc.stderr.splitlines() if x.startswith("kernels: "))
        recorded = json.loads(stats.read_text())["kernels"]
        assert line == f"kernels: {recorded}"
        expected = decide(mode).mode
        buffers, plan = recorded.split("; ", 1)
        assert plan.startswith(f"{expected} (") and "MiB" in buffers
        if expected == "plain":
            assert "CPU_REPACK" not in buffers and "AMX" not in buffers
        if expected == "no-amx":
            assert "AMX" not in buffers
        outs[name] = proc.stdout
    assert outs["spec"] == outs["plain"]


def test_high_level_llama_loads_without_extra_buffers_in_plain_mode():
    import llama_cpp.llama_cpp as C

    from hetero_spec.target.kernels import extra_bufts_off

    assert C.llama_model_default_params().use_extra_bufts
    with extra_bufts_off(KernelPlan("plain", "test")):
        assert not C.llama_model_default_params().use_extra_bufts
    assert C.llama_model_default_params().use_extra_bufts
    with extra_bufts_off(KernelPlan("no-amx", "test")):
        assert C.llama_model_default_params().use_extra_bufts
