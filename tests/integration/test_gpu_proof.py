"""scripts/gpu_proof.sh, here: cpu-check runs the GPU bundle's measuring steps on the CPU, so they cannot rot while
no GPU machine is at hand (the ``run`` mode calls the very same ``steps`` function with ``cuda``); pack, unpack
(``run``'s first step) and slim-wheel run on stand-ins."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_check_runs_every_step_and_every_output_equals_raw(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ,
               # a few tokens of one prompt on two sets: the steps, not the figures, are under test
               GPU_PROOF_PROMPTS="1", GPU_PROOF_TOKENS="12", GPU_PROOF_SETS="gsm8k,humaneval",
               GPU_PROOF_METHODS="raw,auto,chain-k3,tree", GPU_PROOF_X10_METHODS="raw,chain-k3",
               GPU_PROOF_X10_SCALE="1.5", GPU_PROOF_CURVE_THREADS="1", GPU_PROOF_CURVE_REPEATS="1",
               GPU_PROOF_DRAFT_ROUNDS="5", GPU_PROOF_DRAFT_POSITIONS="40")
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


def _travelling_bytes() -> int:
    """What travels with every call of the device tool: the checkout's tracked files and untracked ones git keeps."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def test_pack_cuts_parts_that_fit_a_call_beside_the_checkout_and_unpack_joins_them(tmp_path):
    """pack sizes its parts to what one call carries less the checkout, which travels with every call, one part
    per call folder; unpack (run's first step) names the parts missing or damaged and joins the model byte for
    byte."""
    wheels, model, bundle = tmp_path / "wheels", tmp_path / "stand-in.gguf", tmp_path / "bundle"
    wheels.mkdir()
    for name in ("llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl", "hetero_spec-0-py3-none-any.whl"):
        (wheels / name).write_bytes(os.urandom(4096))
    model.write_bytes(os.urandom(5 * 2**20 + 123))
    part = 2 * 2**20
    env = dict(os.environ, GPU_PROOF_WHEELS_FROM=str(wheels), GPU_PROOF_MODEL=str(model), GPU_PROOF_PLOT_WHEELS="0")
    sh = ["bash", str(ROOT / "scripts" / "gpu_proof.sh")]

    too_small = subprocess.run([*sh, "pack", str(bundle)], env=dict(env, GPU_PROOF_CALL_BYTES=str(2**20)),
                               capture_output=True, text=True, timeout=120)
    assert too_small.returncode != 0 and "no part fits beside it" in too_small.stderr

    calls = dict(env, GPU_PROOF_CALL_BYTES=str(_travelling_bytes() + 2**20 + part))
    packed = subprocess.run([*sh, "pack", str(bundle)], env=calls, capture_output=True, text=True, timeout=120)
    assert packed.returncode == 0, packed.stderr[-3000:]
    folders = sorted(p.name for p in bundle.glob("call-*"))
    assert folders == ["call-01", "call-02", "call-03"]  # 5 MiB and the wheels in 2 MiB parts
    for f in folders:
        parts = list((bundle / f).glob("*.part-*"))
        assert len(parts) == 1 and parts[0].stat().st_size <= part
    order = (bundle / "SEND_ORDER.txt").read_text()
    assert all(f"carry {bundle}/{f}" in order for f in folders) and "bash scripts/gpu_proof.sh run" in order

    held = tmp_path / "held"
    (bundle / "call-02").rename(held)
    missing = subprocess.run([*sh, "unpack", str(bundle), str(tmp_path / "work")], capture_output=True, text=True)
    assert missing.returncode != 0 and "bundle.tar.part-01" in missing.stderr
    held.rename(bundle / "call-02")
    last = next((bundle / "call-03").glob("*.part-*"))
    intact = last.read_bytes()
    last.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))
    damaged = subprocess.run([*sh, "unpack", str(bundle), str(tmp_path / "work")], capture_output=True, text=True)
    assert damaged.returncode != 0 and "damaged" in damaged.stderr and last.name in damaged.stderr
    last.write_bytes(intact)
    joined = subprocess.run([*sh, "unpack", str(bundle), str(tmp_path / "work")], capture_output=True, text=True)
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "work" / "model.gguf").read_bytes() == model.read_bytes()
    assert sorted(p.name for p in (tmp_path / "work" / "wheels").iterdir()) == sorted(p.name for p in wheels.iterdir())


def test_the_slimmed_llama_wheel_keeps_one_library_under_the_two_names_the_loader_opens(tmp_path):
    """zip cannot hold a symlink, so llama-cpp-python's wheel carries each library three times in its package
    and again in lib/ beside include/: slim-wheel keeps libX.so (what ctypes opens) and libX.so.N (the soname
    the libraries name each other by), with a RECORD that pip installs from."""
    import base64
    import hashlib
    import zipfile

    wheel = tmp_path / "fake-0-py3-none-any.whl"
    lib = os.urandom(1000)
    files = {"fake/__init__.py": b"", "fake/lib/libllama.so": lib, "fake/lib/libllama.so.0": lib,
             "fake/lib/libllama.so.0.5.0": lib, "lib/libllama.so": lib, "lib/cmake/x.cmake": b"x",
             "include/llama.h": b"int x;", "fake-0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fake\nVersion: 0\n",
             "fake-0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = lambda b: base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()  # noqa: E731
    record = "".join(f"{n},sha256={digest(b)},{len(b)}\n" for n, b in files.items()) + "fake-0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, b in {**files, "fake-0.dist-info/RECORD": record.encode()}.items():
            z.writestr(n, b)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_proof.sh"), "slim-wheel", str(wheel)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert names == {"fake/__init__.py", "fake/lib/libllama.so", "fake/lib/libllama.so.0", "fake-0.dist-info/METADATA",
                     "fake-0.dist-info/WHEEL", "fake-0.dist-info/RECORD"}
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                                str(site), str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert (site / "fake" / "lib" / "libllama.so.0").read_bytes() == lib
