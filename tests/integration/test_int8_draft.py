"""Int8 drafts on the real target, on this CPU's fbgemm kernels and on the AVX2 (non-VNNI) ones, which
``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` forces in a fresh process on any x86 CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_spec.draft.int8 import INT8_MAX_ERROR, INT8_MIN_AGREEMENT, int8_available

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch build without fbgemm")
ROOT = Path(__file__).resolve().parents[2]
DRAFT = ROOT / "drafts" / "smollm2-135m-eagle.safetensors"


def _probe(model_path: Path, tmp_path: Path, kernels: str | None) -> dict:
    env = dict(os.environ, HETERO_SPEC_CACHE=str(tmp_path))  # a fresh int8 check, not a cached one
    if kernels:
        env["FBGEMM_ENABLE_INSTRUCTIONS"] = kernels
    out = subprocess.run([sys.executable, "-m", "tests.integration.int8_probe", str(model_path), str(DRAFT)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernels", [None, "AVX2"], ids=["this-cpu", "avx2-forced"])
def test_auto_int8_proposes_like_float(model_path, tmp_path, kernels):
    """Whatever kernels run, the mode auto picks stays within the error bound and proposes what the float
    draft proposes on at least 95% of teacher-forced steps of a text the calibration never saw; the
    reduced-range path always qualifies."""
    r = _probe(model_path, tmp_path, kernels)
    assert r["error_reduced"] <= INT8_MAX_ERROR
    assert r["match_int8-reduced"] >= INT8_MIN_AGREEMENT
    assert r["auto"] in ("int8", "int8-reduced")
    picked = "int8-full" if r["auto"] == "int8" else "int8-reduced"
    assert r[f"match_{picked}"] >= INT8_MIN_AGREEMENT
    if kernels == "AVX2":  # the 8-bit path saturates there: the check must see it and take 7 bits
        assert r["error_full"] > INT8_MAX_ERROR
        assert r["auto"] == "int8-reduced"

