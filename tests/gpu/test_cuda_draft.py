"""The CUDA draft path.  Skipped without CUDA: the one part of the suite this machine cannot run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_runner_agrees_with_cpu_runner():
    from tests.unit.test_draft_model import D, V, make_model, run_rows

    from hetero_spec.draft.runner import DraftRunner

    rng = np.random.default_rng(0)
    feats = rng.standard_normal((16, D)).astype(np.float32)
    toks = rng.integers(0, V, 16)
    cpu = DraftRunner(make_model(), device="cpu", dtype="float32")
    gpu = DraftRunner(make_model(), device="cuda", dtype="float32")
    a, b = run_rows(cpu, feats, toks), run_rows(gpu, feats, toks).cpu()
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    gpu.rollback(10)
    assert gpu.n == 10 and len(gpu.propose(feats[:2], toks[:2], k=3)) == 3


def test_cuda_draft_is_lossless_on_real_gguf(model_path, random_draft_path):
    from hetero_spec.api import HeteroSpec

    with HeteroSpec(model_path, random_draft_path, n_ctx=1024, draft_device="cuda") as hs:
        assert hs.draft.device.type == "cuda" and hs.draft.dtype == torch.bfloat16
        msgs = [{"role": "user", "content": "Write two sentences about rivers."}]
        plain = hs.chat(msgs, max_new_tokens=48, draft_len=0).tokens
        hs.reset()
        assert hs.chat(msgs, max_new_tokens=48, draft_len=3).tokens == plain
