"""scripts/gpu_proof.sh cpu-check: the GPU bundle's measuring steps run here, on the CPU, so they cannot rot
while no GPU machine is at hand (the ``run`` mode calls the very same ``steps`` function with ``cuda``)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_check_runs_every_step_and_every_output_equals_raw(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ,
               # a few tokens of one prompt on two sets: the steps, not the figures, are under test
               GPU_PROOF_PROMPTS="1", GPU_PROOF_TOKENS="12", GPU_PROOF_SETS="gsm8k,humaneval",
               GPU_PROOF_METHODS="raw,auto,chain-k3,tree", GPU_PROOF_X10_METHODS="raw,chain-k3",
               GPU_PROOF_X10_SCALE="1.5", GPU_PROOF_CURVE_THREADS="1", GPU_PROOF_CURVE_REPEATS="1",
               GPU_PROOF_DRAFT_ROUNDS="5")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh"), "cpu-check", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "did not finish" not in done.stderr and "not made" not in done.stderr, done.stderr[-3000:]
    for name in ("bench.json", "bench-x10.json"):
        bench = json.loads((out / name).read_text())
        prompts = bench["prompts"]
        assert {p["method"] for p in prompts} == set(env[
            "GPU_PROOF_METHODS" if name == "bench.json" else "GPU_PROOF_X10_METHODS"].split(","))
        assert {p["dataset"] for p in prompts} == {"gsm8k", "humaneval"}
        assert all(p["equal"] for p in prompts), name  # lossless: every method's ids are raw's
        assert "laptop-7b-q4_0" in json.dumps(bench["projections"])
    step = json.loads((out / "draft_step.json").read_text())["settings"]
    from hetero_spec.draft import native

    native_steps = {"native-1t", "native-2t"} if native.load_library() is not None else set()
    assert set(step) == {"float32", "int8-1t-slow", "int8-1t-onerow", "int8-1t", "int8-2t"} | native_steps
    assert all(s["ms_per_step"] > 0 and 0 <= s["equal_k1"] <= 1 for s in step.values())
    curve = json.loads((out / "curve-t1.json").read_text())
    assert curve["verify_ms"] and curve["draft_step_ms"] > 0
    assert (out / "speedup.png").stat().st_size > 0
    assert not (out / "work").exists()  # the x1.5 target is removed afterwards
