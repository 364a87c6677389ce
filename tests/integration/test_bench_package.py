"""A built wheel carries the bench's data: installed alone (no checkout on the path) it benches from /tmp."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this environment")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    # build from a copy: setuptools writes build/ and egg-info beside the sources it builds
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("hetero_spec", "converters"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           str(src), "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (whl,) = out.glob("hetero_spec-*.whl")
    return whl


def test_wheel_holds_prompt_sets_and_curves(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("mt_bench.jsonl", "humaneval.jsonl", "gsm8k.jsonl", "alpaca.jsonl", "README.md",
              "curves/this-machine.json", "curves/laptop-7b-q4_0.json"):
        assert f"hetero_spec/bench/data/{f}" in names


def test_installed_wheel_benches_from_another_directory(wheel, model_path, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("HETERO_SPEC_BENCH_DIR", None)
    where = subprocess.run([sys.executable, "-c", "import hetero_spec; print(hetero_spec.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    proc = subprocess.run([sys.executable, "-m", "hetero_spec", "bench", str(model_path), "--methods", "raw",
                           "--datasets", "humaneval", "--n-prompts", "1", "--max-new-tokens", "4", "-t", "1",
                           "--ctx", "512", "--project", "laptop-7b-q4_0", "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| raw | humaneval |" in proc.stdout and (tmp_path / "out" / "bench.json").is_file()
