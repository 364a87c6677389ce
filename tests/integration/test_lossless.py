"""Speculative output equals plain greedy decoding of the same GGUF, token for token."""
from __future__ import annotations

import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.spec.orchestrator import generate_tokens

from .oracle_draft import OracleDraft

N_NEW = 64
PROMPTS = bench_prompts("mt_bench", 4) + bench_prompts("humaneval", 2) + bench_prompts("gsm8k", 2) + bench_prompts(
    "alpaca", 2
)


@pytest.fixture(scope="module")
def plain_outputs(hs) -> dict[str, list[int]]:
    hs.reset()  # fresh prefills; prefix reuse is batch-invariant too, tested in test_target
    return {p: hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=0).tokens for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_untrained_draft_output_equals_plain(hs, plain_outputs, k):
    """The real draft model's proposals, nearly all rejected, on every other prompt (two of mt_bench, one of each
    other set): the oracle test below exercises every acceptance length on all ten."""
    for p in PROMPTS[::2]:
        out = hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=k)
        assert out.tokens == plain_outputs[p], f"k={k} diverged on {p[:50]!r}"
        assert all(r.drafted <= k for r in out.stats.rounds) and out.stats.rounds


@pytest.mark.parametrize("k", [1, 3, 5])
def test_partially_right_draft_output_equals_plain(hs, plain_outputs, k):
    """Rounds that accept 0..k drafts, on the real target: still exactly the plain output."""
    accepted_counts = set()
    for i, p in enumerate(PROMPTS):
        prompt = hs.target.tokenize(hs.render([{"role": "user", "content": p}]), add_special=False)
        reference = prompt + plain_outputs[p]
        draft = OracleDraft(reference, error_rate=0.25, seed=i)
        hs.target.reset()
        steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=N_NEW, draft_len=k))
        tokens = [t for s in steps for t in s.tokens]
        assert tokens == plain_outputs[p], f"k={k} diverged on {p[:50]!r}"
        rounds = [s.round for s in steps if s.round]
        accepted_counts |= {r.accepted for r in rounds}
        # every hidden row the draft saw belongs to an accepted token (or the prompt)
        assert draft.features_seen <= len(prompt) + len(tokens)
        assert draft.context == prompt + tokens  # the text reaches the draft's context rows, each token once
    assert accepted_counts == set(range(k + 1)), f"not every acceptance length was exercised: {accepted_counts}"


def test_acceptance_counts_match_a_perfect_draft(hs, plain_outputs):
    p = PROMPTS[0]
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": p}]), add_special=False)
    draft = OracleDraft(prompt + plain_outputs[p], error_rate=0.0)
    hs.target.reset()
    steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=N_NEW, draft_len=4))
    rounds = [s.round for s in steps if s.round]
    assert [t for s in steps for t in s.tokens] == plain_outputs[p]
    assert all(r.accepted == r.drafted for r in rounds)  # a perfect draft is never rejected
    assert len(rounds) <= -(-N_NEW // 5) + 1


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_round_that_fills_the_context_emits_what_plain_decoding_does(model_path, random_draft_path, k):
    """Each emitted token is judged with the cells plain decoding holds when it picks it: judged with the
    round's final count, a round that filled the context cut its accepted tokens short (13 against 14)."""
    from hetero_spec import HeteroSpec

    with HeteroSpec(model_path, random_draft_path, n_ctx=64, threads=1) as small:
        prompt = small.target.tokenize(small.render([{"role": "user", "content": "Tell me a story."}]),
                                       add_special=False)
        assert len(prompt) < 48, len(prompt)
        small.target.reset()
        plain = list(generate_tokens(small.target, None, prompt, max_new_tokens=200, draft_len=0))
        reference = [t for s in plain for t in s.tokens]
        assert plain[-1].stop_reason == "context_full"
        for seed in range(3):  # perfect and erring drafts end their last round at different places
            small.target.reset()
            draft = OracleDraft(prompt + reference + [0] * 8, error_rate=0.3 * seed, seed=seed)
            steps = list(generate_tokens(small.target, draft, prompt, max_new_tokens=200, draft_len=k))
            assert [t for s in steps for t in s.tokens] == reference and steps[-1].stop_reason == "context_full"
