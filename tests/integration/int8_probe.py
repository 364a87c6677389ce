"""How int8 draft weights compare with float on this CPU: run as a module so a test can force fbgemm's
kernels with ``FBGEMM_ENABLE_INSTRUCTIONS`` (read once, when torch loads fbgemm) in a fresh process.

``python -m tests.integration.int8_probe MODEL DRAFT`` prints one JSON object: the measured errors of both
int8 modes, the mode ``auto`` picks, and for each forced mode the share of teacher-forced steps whose
proposal equals the float32 draft's, over the target's real features of a fixed text.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

TEXT = (  # a variant of hetero_spec.api.CALIBRATION_TEXT, so that the test does not grade its own calibration
"The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. "
        "Ships passing the rocky coast relied on its beam to find the harbour safely. One stormy night, "
        "the lamp flickered and went out, and he had to repair it before the fishing fleet returned. "
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May.")


def proposals(hs_target, draft: Path, dtype: str, feats: np.ndarray, ids: list[int]):
    from hetero_spec.api import load_runner
    from hetero_spec.config import DenoiseConfig

    runner = load_runner(hs_target, draft, device="cpu", dtype=dtype, denoise=DenoiseConfig())
    out = [runner.propose(feats[t : t + 1], [ids[t + 1]], k=1)[0] for t in range(len(ids) - 1)]
    return runner, np.array(out)


def probe(model: Path, draft: Path) -> dict:
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    with LlamaTarget(model, TargetOptions(n_ctx=1024, n_threads=1)) as target:
        ids = target.tokenize(TEXT)
        feats, _ = target.prefill(ids)
        auto, ref = proposals(target, draft, "float32", feats, ids)
        auto, _ = proposals(target, draft, "auto", feats, ids)
        result = {"error_full": auto.int8_check.error_full, "error_reduced": auto.int8_check.error_reduced,
                  "auto": auto.weights, "steps": len(ref)}
        for mode in ("int8-full", "int8-reduced"):
            _, got = proposals(target, draft, mode, feats, ids)
            result[f"match_{mode}"] = float((got == ref).mean())
    return result


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]), Path(sys.argv[2]))))
