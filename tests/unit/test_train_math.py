"""Training math on synthetic tensors: loss terms, gradients to the gate, the unrolled forward."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from hetero_spec.draft.runner import DraftRunner
from hetero_spec.train.losses import LossWeights, centred_topk_mse, gate_regularization, kl_divergence, step_loss
from hetero_spec.train.unroll import unrolled_forward
from tests.unit.test_draft_model import CFG, D, V, make_model


def test_kl_is_zero_for_equal_distributions_and_positive_otherwise():
    logits = torch.randn(5, 30)
    lp = logits.log_softmax(-1)
    assert torch.allclose(kl_divergence(lp, lp), torch.zeros(5), atol=1e-6)
    other = torch.randn(5, 30).log_softmax(-1)
    assert (kl_divergence(lp, other) > 0).all()


def test_logit_matching_ignores_a_constant_shift():
    p = torch.randn(4, 50)
    assert torch.allclose(centred_topk_mse(p, p + 3.0, 8), torch.zeros(4), atol=1e-5)
    assert (centred_topk_mse(p, torch.randn(4, 50), 8) > 0).all()


def test_gate_regularization_pulls_toward_the_keep_ratio_from_both_sides():
    valid = torch.ones(2, 6, dtype=torch.bool)
    at_ratio = [torch.full((2, 6), 0.7).log()]
    assert gate_regularization(at_ratio, valid, 0.7).item() < 1e-10
    open_gate = [torch.full((2, 6), 0.99).log()]
    closed = [torch.full((2, 6), 0.01).log()]
    assert gate_regularization(open_gate, valid, 0.7) > 0 and gate_regularization(closed, valid, 0.7) > 0
    g = torch.full((2, 6), 0.95).log().requires_grad_()
    gate_regularization([g], valid, 0.7).backward()
    assert (g.grad > 0).all()  # descending the gradient lowers an over-open gate


def test_gradients_reach_the_importance_gate_through_the_distillation_loss():
    m = make_model()
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.standard_normal((2, 10, D)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, V, (2, 10)))
    valid = torch.ones(2, 10, dtype=torch.bool)
    steps = unrolled_forward(m, feats, ids, valid, 2)
    loss = sum(step_loss(s.features, feats, valid, m.head, LossWeights()).total for s in steps)
    loss.backward()
    for blk in m.blocks:
        assert blk.importance.weight.grad is not None and blk.importance.weight.grad.abs().sum() > 0


def test_eagle_recipe_has_no_kl_term_and_darter_has():
    m = make_model()
    f = torch.randn(1, 6, D)
    mask = torch.ones(1, 6, dtype=torch.bool)
    e = step_loss(f + 0.1, f, mask, m.head, LossWeights(recipe="eagle"))
    d = step_loss(f + 0.1, f, mask, m.head, LossWeights(recipe="darter"))
    assert "kl" not in e.parts and d.parts["kl"] > 0
    perfect = step_loss(f, f, mask, m.head, replace(LossWeights(), token_weighting=False))
    assert perfect.total.item() < 1e-5  # predicting the target's feature exactly costs nothing


def test_unrolled_step0_equals_teacher_forced_forward():
    m = make_model()
    rng = np.random.default_rng(1)
    feats = torch.from_numpy(rng.standard_normal((2, 9, D)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, V, (2, 9)))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False  # right padding on the second row
    with torch.no_grad():
        full, _ = m(feats, ids, valid)
        step0 = unrolled_forward(m, feats, ids, valid, 1)[0].features
    torch.testing.assert_close(step0[0], full[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step0[1, :6], full[1, :6], rtol=1e-4, atol=1e-4)


VARIANTS = {
    "darter-final": replace(CFG, n_blocks=2),
    "darter-taps": replace(CFG, n_blocks=2, taps=(1, 3)),
    "eagle3-taps": replace(CFG, n_blocks=1, fusion="eagle3", gate="none", taps=(0, 2, 5)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_unrolled_steps_match_what_the_runner_does_at_inference(variant):
    """Chain s, step j: real cells 0..s, then cells computed from the draft's own g (its predicted feature,
    or with taps its pre-norm state, as EAGLE-3)."""
    cfg = VARIANTS[variant]
    m = make_model(cfg)
    rng = np.random.default_rng(2)
    T, s, steps = 10, 5, 3
    feats = rng.standard_normal((T, cfg.input_size)).astype(np.float32)
    ids = rng.integers(0, V, T)  # ids[t] = x_{t+1}, the draft's token input at t
    with torch.no_grad():
        un = unrolled_forward(m, torch.from_numpy(feats)[None], torch.from_numpy(ids)[None],
                              torch.ones(1, T, dtype=torch.bool), steps)
    r = DraftRunner(m, device="cpu", dtype="float32")
    with torch.inference_mode():
        x, pred = r._forward(r._real(feats[: s + 1]), torch.from_numpy(ids[: s + 1])[None])
        x, pred = x[:, -1:], pred[:, -1:]
        torch.testing.assert_close(pred[0, 0], un[0].features[0, s], rtol=1e-4, atol=1e-4)
        for j in range(1, steps):
            x, pred = r._forward(m.drafted_input(x, pred), torch.from_numpy(ids[s + j : s + j + 1])[None])
            torch.testing.assert_close(pred[0, 0], un[j].features[0, s], rtol=1e-4, atol=1e-4)
    # and the runner's own chain proposes what the unrolled argmaxes say
    r.reset()
    chain = r.propose(feats[: s + 1], ids[: s + 1], k=steps)
    expect = [int(m.d2t[m.logits(un[j].features[0, s]).argmax()]) for j in range(steps)]
    assert chain[0] == expect[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_selected_queries_and_sampled_chains_equal_the_full_unrolled_pass(variant):
    """Computing only the scored rows (queries) and continuing only some chains changes which rows
    exist, never their values: each selected row equals the same row of the full pass, at every step,
    with padding, holes and per-row selections of different sizes."""
    cfg = VARIANTS[variant]
    m = make_model(cfg)
    rng = np.random.default_rng(4)
    B, T, steps = 3, 12, 3
    feats = torch.from_numpy(rng.standard_normal((B, T, cfg.input_size)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, V, (B, T)))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[2, 9:] = False
    holes = torch.tensor([0, 4, 0])
    queries = torch.from_numpy(rng.random((B, T)) < 0.6) & valid
    queries[1, :4] = False
    chains = torch.from_numpy(rng.random((B, T)) < 0.5)
    with torch.no_grad():
        full = unrolled_forward(m, feats, ids, valid, steps, holes)
        part = unrolled_forward(m, feats, ids, valid, steps, holes, queries, chains)
    for j, (f, p) in enumerate(zip(full, part)):
        want = queries if j == 0 else queries & chains
        for b in range(B):
            rows = p.pos[b][p.live[b]]
            assert rows.tolist() == want[b].nonzero().flatten().tolist()
            torch.testing.assert_close(p.features[b][p.live[b]], f.features[b, rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("empty", ["chains", "queries"])
def test_a_batch_that_continues_no_chain_trains_step_zero_only(variant, empty):
    """A sampled chain selection can be empty (a short batch, --chain-sample 0.33): the pass then stops
    after step 0 instead of failing on zero rows (it did, at step 302 of a real run), and its loss is finite."""
    cfg = VARIANTS[variant]
    m = make_model(cfg)
    B, T = 1, 10
    feats = torch.randn(B, T, cfg.input_size)
    ids = torch.randint(0, V, (B, T))
    valid = torch.ones(B, T, dtype=torch.bool)
    queries = torch.zeros(B, T, dtype=torch.bool) if empty == "queries" else torch.rand(B, T) < 0.7
    chains = torch.zeros(B, T, dtype=torch.bool)
    out = unrolled_forward(m, feats, ids, valid, 3, None, queries, chains)
    assert len(out) == 1 and int(out[0].live.sum()) == int(queries.sum())
    target = torch.randn(B, out[0].features.shape[1], D)
    loss = step_loss(out[0].features, target, out[0].live, m.head, LossWeights())
    assert torch.isfinite(loss.total)


def test_a_cpu_budget_counts_cpu_seconds_per_thread_not_wall_time():
    """On a shared machine the wall clock runs while a run waits for a core; a cpu budget does not."""
    from hetero_spec.train.loop import TrainConfig, _spent

    state = {"train_s": 100.0, "cpu_s": 30.0 * torch.get_num_threads()}
    assert _spent(state, TrainConfig(budget_clock="wall")) == 100.0
    assert _spent(state, TrainConfig(budget_clock="cpu")) == pytest.approx(30.0)


def test_a_cpu_budget_is_continuous_when_a_resume_changes_the_thread_count():
    """Resuming a one-thread run on two threads must not halve the time already spent."""
    from hetero_spec.train.loop import TrainConfig, _spent

    from hetero_spec.train.loop import _add_step_cpu

    cfg = TrainConfig(budget_clock="cpu")
    state = {"train_s": 100.0}
    _add_step_cpu(state, 30.0, threads=1)  # 30 s on one thread
    _add_step_cpu(state, 60.0, threads=2)  # then resumed on two: 60 CPU-s in 30 s
    assert state["cpu_s"] == 90.0
    assert _spent(state, cfg) == 60.0
    assert _spent(state, TrainConfig(budget_clock="wall")) == 100.0
