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


def _cuda_runner(dtype: str = "float32", graph: bool = True):
    from tests.unit.test_draft_model import _gated_model

    from hetero_spec.draft.runner import DraftRunner

    r = DraftRunner(_gated_model(), device="cuda", dtype=dtype)
    r.cuda_graph = graph
    return r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_chain_proposes_what_the_eager_chain_proposes(dtype):
    """A chain whose one-position steps replay one CUDA graph (static shapes, position as a device tensor)
    proposes the same ids as the eager chain, round after round with rollbacks, and leaves the same cache.
    In bf16 the graph's attention sums over the whole fixed cache (masked cells add exact zeros, in another
    order), so a near-tie may round the other way: there nine chains in ten must match."""
    from tests.unit.test_draft_model import D, V

    rng = np.random.default_rng(1)
    feats = rng.standard_normal((40, D)).astype(np.float32)
    toks = rng.integers(0, V, 40)
    graphed, eager = _cuda_runner(dtype, True), _cuda_runner(dtype, False)
    for r in (graphed, eager):
        r.prefill(feats[:10], toks[:10])
    same = []
    for i in range(10, 40, 2):
        a = graphed.propose(feats[i : i + 1], toks[i : i + 1], k=4)
        b = eager.propose(feats[i : i + 1], toks[i : i + 1], k=4)
        same.append(a == b)
        graphed.rollback(graphed.n - 3)
        eager.rollback(eager.n - 3)
    assert graphed._static is not None and graphed._static._graph is not None
    assert all(same) if dtype == "float32" else np.mean(same) >= 0.9
    n = graphed.n
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(graphed.cache.k[0][:, :, :n].float(), eager.cache.k[0][:, :, :n].float(), **tol)


def test_graphed_step_equals_the_cpu_one_row_forward():
    """The captured step on CUDA against the CPU's one-position forward, float32, feature by feature."""
    from tests.unit.test_draft_model import D, V, _gated_model

    from hetero_spec.draft.runner import DraftRunner
    from hetero_spec.draft.static_step import StaticStep

    rng = np.random.default_rng(2)
    feats = rng.standard_normal((12, D)).astype(np.float32)
    toks = rng.integers(0, V, 12)
    cpu = DraftRunner(_gated_model(), device="cpu", dtype="float32")
    gpu = _cuda_runner()
    for r in (cpu, gpu):
        r.prefill(feats[:8], toks[:8])
    step = StaticStep(gpu)
    with torch.inference_mode():
        for i in range(8, 12):
            want = cpu._forward_one(cpu.model.real_input(torch.from_numpy(feats[i : i + 1])[None]),
                                    torch.from_numpy(toks[i : i + 1])[None])
            got = step(gpu._real(feats[i : i + 1]), gpu._tokens(toks[i : i + 1]))
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-3, atol=1e-3)


def test_rows_arrive_through_pinned_memory():
    """The hand-off in: host rows are staged in page-locked memory and copied without blocking; the staging
    buffer is reused (grown when needed) and a later round's rows never overwrite a copy in flight."""
    from tests.unit.test_draft_model import D

    r = _cuda_runner()
    rng = np.random.default_rng(3)
    first = rng.standard_normal((3, D)).astype(np.float32)
    a = r._to_device(first)
    staged, _ = r._pinned[torch.float32]
    assert staged.is_pinned() and a.device.type == "cuda"
    second = rng.standard_normal((5000, D)).astype(np.float32)  # larger: a new buffer
    b = r._to_device(second)
    torch.testing.assert_close(a.cpu(), torch.from_numpy(first))
    torch.testing.assert_close(b.cpu(), torch.from_numpy(second))
    assert r._pinned[torch.float32][0].numel() >= second.size
