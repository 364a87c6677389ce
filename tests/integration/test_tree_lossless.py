"""Trees on the real GGUF: greedy tree output equals plain decoding; kept branches equal fresh decodes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.calibration import CostCurve
from hetero_spec.config import SpecConfig, TreeSpec
from hetero_spec.errors import HeteroSpecError
from hetero_spec.spec.orchestrator import generate_tokens
from hetero_spec.spec.lookup import NgramLookup
from hetero_spec.spec.policy import CATCHUP_ROWS, AutoPolicy, FixedPolicy, Shape
from hetero_spec.spec.tree import Tree
from tests.curves import cheap_rows_in

from .oracle_draft import OracleDraft

N_NEW = 32
PROMPTS = bench_prompts("mt_bench", 1) + bench_prompts("humaneval", 1) + bench_prompts("gsm8k", 1)


@dataclass
class _Proposal:
    tokens: np.ndarray
    parents: np.ndarray
    q: list
    n_real: int
    depth_forwards: int = 0
    forwarded_rows: int = 0


class OracleTreeDraft(OracleDraft):
    """OracleDraft grown into trees: at every depth, child 0 continues the reference (corrupted
    with ``error_rate``) and the other ``top_k - 1`` children are wrong siblings, one of which
    holds the right token whenever child 0 was corrupted, so acceptance runs through every branch."""

    def propose_tree(self, features, tokens, *, top_k, total_tokens, depth, sampling=None, rng=None, p_min=0.0):
        assert features.shape[0] == len(tokens) and features.dtype == np.float32
        self.features_seen += features.shape[0]
        self.cell_tokens.extend(int(t) for t in tokens)
        n_real = self.n
        toks, parents, node, budget = [-1], [-1], 0, total_tokens
        forwards = rows = 0
        for d in range(depth):
            ref_i = n_real + 1 + d
            right = self.reference[ref_i] if ref_i < len(self.reference) else 0
            kids = [(right + 1 + j) % 49152 for j in range(top_k)]
            if self.rng.random() >= self.error_rate:
                kids[0] = right
            elif top_k > 1 and self.rng.random() < 0.5:
                kids[int(self.rng.integers(1, top_k))] = right
            first = len(toks)
            for t in kids[:budget]:
                toks.append(t)
                parents.append(node)
            budget -= min(top_k, budget)
            if budget <= 0:
                break
            node = first + next((j for j, t in enumerate(kids) if t == right), 0)
            if d < depth - 1:  # the runner forwards this level's nodes to grow the next
                forwards, rows = forwards + 1, rows + len(toks) - first
        return _Proposal(np.array(toks), np.array(parents), [None] * len(toks), n_real, forwards, rows)


@pytest.fixture(scope="module")
def plain_outputs(hs) -> dict[str, list[int]]:
    hs.reset()
    return {p: hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=0).tokens for p in PROMPTS}


@pytest.mark.parametrize("width, total, depth", [(1, 4, 4), (3, 12, 5)])
def test_oracle_tree_output_equals_plain(hs, plain_outputs, width, total, depth):
    """Rounds that accept every depth along every branch, on the real target: still the plain output."""
    seen = set()
    for i, p in enumerate(PROMPTS):
        prompt = hs.target.tokenize(hs.render([{"role": "user", "content": p}]), add_special=False)
        draft = OracleTreeDraft(prompt + plain_outputs[p], error_rate=0.3, seed=i)
        hs.target.reset()
        steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=N_NEW, draft_len=depth,
                                     policy=FixedPolicy(Shape(depth, width, total))))
        assert [t for s in steps for t in s.tokens] == plain_outputs[p], f"diverged on {p[:50]!r}"
        assert draft.context == prompt + plain_outputs[p]  # the text reaches the context rows, each token once
        seen |= {s.round.accepted for s in steps if s.round}
    assert len(seen) >= 3, f"acceptance lengths exercised: {seen}"
    assert width == 1 or any(s.round.drafted > depth for s in steps if s.round)  # branches were drafted
    rounds = [s.round for s in steps if s.round and s.round.drafted]
    assert all(1 <= r.levels <= min(depth, r.drafted) for r in rounds)  # one draft forward per depth, recorded
    # a tree's later forwards each over at least one node; a chain's forwards are its steps, priced as such
    assert all(r.draft_rows >= r.levels - 1 if width > 1 else r.draft_rows == 0 for r in rounds)
    assert width == 1 or any(r.levels < r.drafted for r in rounds)


@pytest.mark.parametrize("width, total", [(4, 16), (2, 3)])
def test_untrained_draft_tree_output_equals_plain(hs, plain_outputs, width, total):
    for p in PROMPTS[:2]:
        out = hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=6,
                      tree=TreeSpec(top_k=width, total_tokens=total, depth=6))
        assert out.tokens == plain_outputs[p]
        assert max(r.drafted for r in out.stats.rounds) > width  # real trees were drafted


class LateDrafting(FixedPolicy):
    """Expects no drafting at the prefill (so the prompt gets no hidden rows), runs ``plain``
    undrafted rounds, then drafts ``shape`` every round; records the round times it is given."""

    def __init__(self, shape: Shape, plain: int) -> None:
        super().__init__(shape)
        self.plain, self.timed = plain, []

    def expects_drafting(self) -> bool:
        return False

    def choose(self, lookup: int = 0, match: int = 0) -> Shape:
        self.plain -= 1
        return Shape(0) if self.plain >= 0 else self.shape

    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float, kept_row: bool = False) -> None:
        self.timed.append((shape.depth, rows_consumed, seconds))


@pytest.mark.parametrize("plain_rounds", [5, 24])
def test_drafting_after_a_lazy_prefill_equals_plain(hs, plain_outputs, plain_rounds):
    """The prompt is prefilled without hidden states and the draft skips it; drafting that starts
    later catches up on the rows generated since (at most CATCHUP_ROWS, older ones become holes),
    and the output is still the plain one."""
    p = PROMPTS[1]
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": p}]), add_special=False)
    draft = OracleTreeDraft(prompt + plain_outputs[p], error_rate=0.3, seed=3)
    policy = LateDrafting(Shape(3), plain=plain_rounds)
    hs.target.reset()
    steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=N_NEW, draft_len=3, policy=policy))
    assert [t for s in steps for t in s.tokens] == plain_outputs[p]
    caught_up = min(plain_rounds, CATCHUP_ROWS)  # one row per plain round; the prefill gave the draft none
    holes = len(prompt) + plain_rounds - caught_up
    assert draft.cell_tokens[:holes] == [-1] * holes and -1 not in draft.cell_tokens[holes:]
    first_drafted = next(t for t in policy.timed if t[0] > 0)
    assert first_drafted[1] == caught_up
    assert [t[0] for t in policy.timed[:plain_rounds]] == [0] * plain_rounds and all(t[2] > 0 for t in policy.timed)
    assert sum(s.round.accepted for s in steps if s.round) > 0


class LookupWhenOffered(FixedPolicy):
    """Drafts by prompt lookup whenever a match is offered (1 token, then all offered, in turn), else
    a plain round; records what it is told."""

    lookup_depth = 3

    def __init__(self) -> None:
        super().__init__(Shape(0))
        self.lookup_rounds, self.observed, self.chains = 0, [], []

    def choose(self, lookup: int = 0, match: int = 0) -> Shape:
        self.lookup_rounds += bool(lookup)
        return Shape(1 if self.lookup_rounds % 2 else min(lookup, 3), source="lookup") if lookup else Shape(0)

    def observe(self, drafted_depth: int, accepted: int, source: str = "draft") -> None:
        self.observed.append((drafted_depth, accepted, source))

    def observe_lookup_chain(self, match: int, drafted_depth: int, accepted: int) -> None:
        self.chains.append((match, drafted_depth, accepted))


REPEAT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."


def test_prompt_lookup_rounds_equal_plain(hs):
    """Chains proposed by prompt lookup, verified on the real target: the plain output, and some accepted."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": REPEAT}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    draft = OracleTreeDraft(prompt + plain, error_rate=1.0)  # the model draft is never asked
    policy = LookupWhenOffered()
    hs.target.reset()
    steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=48, draft_len=1, policy=policy))
    rounds = [s.round for s in steps if s.round]
    assert [t for s in steps for t in s.tokens] == plain
    assert all(r.source == "lookup" for r in rounds if r.drafted) and sum(r.accepted for r in rounds) >= 3
    assert draft.features_seen == 0  # lookup rounds leave the draft model alone
    # a fully accepted one-token round also reports depth 2, checked against the bonus token
    assert any(d == 2 and src == "lookup" for d, _, src in policy.observed)
    assert all(0 <= a <= d for d, a, _ in policy.observed)
    assert policy.chains == []  # every offer was verified: nothing left to check in the shadow


class PlainWithLookupEvidence(FixedPolicy):
    """Never drafts, but takes lookup offers' free evidence."""

    lookup_depth = 3

    def __init__(self) -> None:
        super().__init__(Shape(0))
        self.shadows: list[float] = []

    def observe_shadow(self, source: str, p_accept: float) -> None:
        self.shadows.append(p_accept)


def test_sampled_lookup_evidence_is_a_probability_and_leaves_the_draws_alone(hs):
    """Sampling: a plain round reports p(offered token) as lookup evidence; the draws stay those
    of plain sampling with the same seed."""
    from hetero_spec.config import SamplingConfig

    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": REPEAT}]), add_special=False)
    sampling = SamplingConfig(temperature=0.7, seed=5)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=40, draft_len=0, sampling=sampling).tokens
    policy = PlainWithLookupEvidence()
    hs.target.reset()
    steps = list(generate_tokens(hs.target, OracleTreeDraft(prompt, 1.0), prompt, max_new_tokens=40, draft_len=1,
                                 sampling=sampling, policy=policy))
    assert [t for s in steps for t in s.tokens] == plain
    assert policy.shadows and all(0.0 <= p <= 1.0 + 1e-9 for p in policy.shadows)
    assert max(policy.shadows) > 0.5  # repeating the sentence: lookup's guesses are likely


class PlainWithLookupChains(FixedPolicy):
    """Never drafts; records the settled greedy lookup proposals (match length, depth, accepted)."""

    lookup_depth = 3

    def __init__(self) -> None:
        super().__init__(Shape(0))
        self.chains: list[tuple[int, int, int]] = []
        self.shadows: list[float] = []

    def observe_lookup_chain(self, match: int, drafted_depth: int, accepted: int) -> None:
        self.chains.append((match, drafted_depth, accepted))

    def observe_shadow(self, source: str, p_accept: float) -> None:
        self.shadows.append(p_accept)


CODE_REPEAT = "Write a Python function that adds two numbers, then call it three times with different numbers."


def expected_lookup_chains(prompt: list[int], out: list[int], depth: int) -> list[tuple[int, int, int]]:
    """What checking unverified lookup proposals against plain output must report: a proposal opens
    on a round that has none open, and settles at its first wrong token, when all were right, or,
    partly checked, at the end of the output."""
    text, chains, open_ = list(prompt) + out[:1], [], None
    for tok in out[1:]:
        if open_ is None:
            guesses, match = NgramLookup(text).propose_matched(depth)
            open_ = [guesses, 0, match] if guesses else None
        if open_ is not None:
            guesses, right, match = open_
            if tok != guesses[right] or right + 1 == len(guesses):
                chains.append((match, len(guesses), right + (tok == guesses[right])))
                open_ = None
            else:
                open_[1] += 1
        text.append(tok)
    if open_ is not None and open_[1]:
        chains.append((open_[2], open_[1], open_[1]))
    return chains


def test_greedy_lookup_proposals_are_checked_whole_against_the_plain_output(hs):
    """Greedy plain rounds check what prompt lookup offered, all of it, against the tokens that
    follow, and report it with the length of the match behind it; the output stays plain."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": CODE_REPEAT}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    policy = PlainWithLookupChains()
    hs.target.reset()
    steps = list(generate_tokens(hs.target, OracleTreeDraft(prompt, 1.0), prompt, max_new_tokens=48, draft_len=1,
                                 policy=policy))
    assert [t for s in steps for t in s.tokens] == plain
    assert policy.chains == expected_lookup_chains(prompt, plain, policy.lookup_depth)
    assert any(a == d == 3 and m >= 4 for m, d, a in policy.chains)  # repeated code, behind a long match
    assert any(a < d for _, d, a in policy.chains)
    assert not policy.shadows  # greedy: no first-token evidence besides the chains


class ShadowProbeEvery(FixedPolicy):
    """Plain rounds with a greedy probe of ``depth`` drafted tokens every ``every`` rounds; records
    the evidence the probes settle into."""

    def __init__(self, every: int, depth: int) -> None:
        super().__init__(Shape(0))
        self.every, self.depth, self.rounds, self.settled = every, depth, 0, []

    def choose(self, lookup: int = 0, match: int = 0) -> Shape:
        self.rounds += 1
        return Shape(self.depth, probe=True) if self.rounds % self.every == 0 else Shape(0)

    def wants_rows(self, within: int) -> bool:
        return True  # every plain row reaches the draft, so each probe starts from real rows

    def observe_probe(self, drafted_depth: int, accepted: int) -> None:
        self.settled.append((drafted_depth, accepted))


@pytest.mark.parametrize("error_rate", [0.0, 0.4, 1.0])
def test_greedy_shadow_probes_draft_a_chain_that_the_next_tokens_settle(hs, monkeypatch, error_rate):
    """A greedy probe drafts 3 tokens and verifies none: the target's next tokens say how many a
    verified chain would have accepted, and that is what the policy is told; the output is plain."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": PROMPTS[0]}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=60, draft_len=0).tokens
    draft = OracleTreeDraft(prompt + plain, error_rate=error_rate, seed=4)
    out: list[int] = []
    probes: list[tuple[int, list[int]]] = []  # (output position of the probe round's token, guesses)
    propose = draft.propose
    monkeypatch.setattr(draft, "propose", lambda f, t, k: probes.append((len(out), propose(f, t, k))) or probes[-1][1])
    policy = ShadowProbeEvery(every=5, depth=3)
    hs.target.reset()
    shadow_rounds = []
    for step in generate_tokens(hs.target, draft, prompt, max_new_tokens=60, draft_len=1, policy=policy):
        out.extend(step.tokens)
        if step.round and step.round.shadow:
            shadow_rounds.append(step.round)
    assert out == plain
    assert len(probes) == len(shadow_rounds) >= 8
    assert all(r.shadow == 3 and r.drafted == 0 and r.draft_s > 0 for r in shadow_rounds)
    expected = []
    for pos, guesses in probes:
        target = plain[pos : pos + 3]
        matched = next((i for i, (g, t) in enumerate(zip(guesses, target)) if g != t), len(target))
        if matched < len(target):
            expected.append((3, matched))  # settled at the first mismatch
        elif len(target) == 3:
            expected.append((3, 3))
        elif matched:
            expected.append((matched, matched))  # cut short by the end: the checked depths
    assert policy.settled == expected
    if error_rate == 0.0:
        assert all(a == 3 for _, a in policy.settled[:-1])
    if error_rate == 0.4:
        assert len({a for _, a in policy.settled}) >= 2  # partial chains: the settling point varies
    if error_rate == 1.0:
        assert all(a == 0 for _, a in policy.settled)
    assert draft.n <= len(prompt) + len(plain)  # the drafted tokens' cells were rolled back


def test_auto_output_equals_plain(hs, plain_outputs):
    p = PROMPTS[0]
    assert hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len="auto").tokens == plain_outputs[p]


def auto_that_never_drafts() -> AutoPolicy:
    """Auto sizing on a curve where t(2) = 2 t(1): a draft must be sure to pay, so it only probes."""
    return AutoPolicy(CostCurve({n: 10.0 * n for n in range(1, 33)}, 5.0))


def test_auto_plain_stretches_decode_without_embeddings_and_probes_still_get_their_rows(hs, monkeypatch):
    """A draft that never pays: auto decodes most plain rounds with embeddings off, like plain
    decoding, turns them on CATCHUP_ROWS rounds before each probe so the probe has its rows,
    and the output stays the plain one."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": PROMPTS[0]}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=128, draft_len=0).tokens
    assert len(plain) == 128  # long enough for several probes
    draft = OracleTreeDraft(prompt + plain, error_rate=1.0)
    probe_rows: list[int] = []
    propose = draft.propose
    monkeypatch.setattr(draft, "propose", lambda f, t, k: probe_rows.append(len(t)) or propose(f, t, k))
    embeddings: list[bool] = []
    verify = hs.target.verify
    monkeypatch.setattr(hs.target, "verify", lambda t: embeddings.append(hs.target.embeddings) or verify(t))
    context_calls: list[int] = []
    add_context = draft.add_context
    monkeypatch.setattr(draft, "add_context", lambda t: context_calls.append(len(t)) or add_context(t))
    hs.target.reset()
    steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=128, draft_len=1,
                                 policy=auto_that_never_drafts()))
    assert [t for s in steps for t in s.tokens] == plain
    # plain rounds hand their tokens to the draft's context head in batches, before it next runs
    assert draft.context == prompt + plain and len(context_calls) <= len(probe_rows) + 3
    assert len(probe_rows) >= 3 and all(m >= CATCHUP_ROWS - 1 for m in probe_rows)
    assert 0.3 * len(embeddings) <= embeddings.count(False) < len(embeddings)
    assert draft.n <= hs.target.n_past  # holes after the last probe are skipped only when the draft next runs
    assert -1 in draft.cell_tokens[len(prompt):]  # plain rounds' positions became holes


def test_a_full_draft_takes_no_more_holes_and_the_output_stays_plain(hs, monkeypatch):
    """Plain rounds without embeddings skip the draft's positions; once its context is full they stop."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": PROMPTS[0]}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=96, draft_len=0).tokens
    draft = OracleTreeDraft(prompt + plain, error_rate=1.0, max_positions=len(prompt) + 40)
    skip = draft.skip

    def bounded_skip(n: int) -> None:
        assert draft.n + n <= draft.max_positions, "skipped past the draft's context"
        skip(n)

    monkeypatch.setattr(draft, "skip", bounded_skip)
    hs.target.reset()
    steps = list(generate_tokens(hs.target, draft, prompt, max_new_tokens=96, draft_len=1,
                                 policy=auto_that_never_drafts()))
    assert [t for s in steps for t in s.tokens] == plain and draft.n <= draft.max_positions


#        0 (root)
#       / \\
#      1   2
#     / \\   \\
#    3   4   5
#    |
#    6
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])


def test_tree_rows_equal_chain_decodes_and_kept_branches_equal_fresh_decodes(hs):
    """Verify a hand-built tree in one decode: every row equals decoding its path as a chain; after
    keeping any node's path, the next decode's logits equal those after a fresh decode of that path."""
    t = hs.target
    prompt = t.tokenize(bench_prompts("alpaca", 3)[2])
    t.set_embeddings(True)
    words = t.tokenize(" the cat sat on a warm mat", add_special=False)
    tree = Tree(np.array([prompt[-1], *words[:6]]), PARENTS)
    probe = t.tokenize(" and then", add_special=False)
    t.reset()
    t.prefill(prompt[:-1])
    tree_logits = t.verify_tree(tree.tokens, tree.depth, tree.seq_ids)[0].copy()
    for node in range(tree.n):
        path = tree.path_to(node)
        t.reset()
        t.prefill(prompt[:-1])
        chain = t.verify(tree.tokens[path])[0].copy()
        np.testing.assert_array_equal(tree_logits[path], chain)
        fresh_next = t.verify(probe)[0].copy()
        t.reset()
        t.prefill(prompt[:-1])
        t.verify_tree(tree.tokens, tree.depth, tree.seq_ids)
        t.keep_branch(tree.seq_of(node), [int(x) for x in tree.tokens[path]])
        assert t.n_past == len(prompt) - 1 + len(path) == t.kv_pos_max() + 1
        assert all(t.seq_pos_max(s) == -1 for s in range(1, len(tree.leaves)))  # other branches gone
        np.testing.assert_array_equal(t.verify(probe)[0], fresh_next)


@pytest.mark.parametrize("rule, should_pass", [("correct", True), ("broken", False)])
def test_sampling_through_a_real_tree_follows_the_targets_distribution(hs, rule, should_pass):
    """Real GGUF: one tree verification gives p at the root; the draft's q is the target's own
    distribution flattened (temperature 3), so drafts are often but not always accepted.  The
    tokens speculation emits must follow processed p (chi-square p > 0.01); a rule that
    resamples from p itself after a rejection must fail the same test."""
    from hetero_spec.config import SamplingConfig
    from hetero_spec.spec.sampling import draw_without_replacement, process_logits
    from hetero_spec.spec.verify import residual, sample_accept_tree
    from tests.stats import chi2_pvalue

    t = hs.target
    prompt = t.tokenize("Once upon a time, in a small village by the sea, there lived a")
    cfg = SamplingConfig(temperature=0.8, top_k=6, top_p=1.0, min_p=0.0)
    t.set_embeddings(True)
    t.reset()
    t.prefill(prompt[:-1])
    rng = np.random.default_rng(7)
    logits = t.verify_tree(np.array([prompt[-1]]), np.array([0]), [[0]])[0][0].copy()
    t.keep_branch(0, [prompt[-1]])
    p = process_logits(logits, cfg)
    q = process_logits(logits, SamplingConfig(temperature=3.0, top_k=6, top_p=1.0, min_p=0.0))
    order = np.argsort(-p)[:6]
    q[order] = q[order][::-1]  # the draft prefers what the target finds least likely
    counts = np.zeros_like(p)
    for _ in range(6000):
        kids = draw_without_replacement(q, 2, rng)
        tree = Tree(np.array([prompt[-1], *kids]), np.array([-1, 0, 0]))
        path, nxt = sample_accept_tree(tree.children, tree.tokens, lambda n: p, lambda n: q, rng,
                                       residual if rule == "correct" else (lambda a, b: a))
        counts[int(tree.tokens[path[0]]) if path else nxt] += 1  # the first token emitted
    pval = chi2_pvalue(counts, p)
    assert (pval > 0.01) == should_pass, pval


def test_sampled_generation_is_reproducible_and_tree_paths_run(hs):
    from hetero_spec.config import SamplingConfig

    msgs = [{"role": "user", "content": "Tell me about the moon."}]
    hs.reset()  # the same seed from the same cache state (see SamplingConfig)
    a = hs.chat(msgs, max_new_tokens=20, draft_len=3, sampling=SamplingConfig(temperature=0.8, seed=1))
    hs.reset()
    b = hs.chat(msgs, max_new_tokens=20, draft_len=3, sampling=SamplingConfig(temperature=0.8, seed=1))
    c = hs.chat(msgs, max_new_tokens=20, draft_len=3, sampling=SamplingConfig(temperature=0.8, seed=2),
                tree=TreeSpec(total_tokens=8, depth=4, top_k=2))
    assert a.tokens == b.tokens and len(a.tokens) == 20
    assert c.tokens != a.tokens and c.stats.rounds and max(r.drafted for r in c.stats.rounds) > 2


def test_auto_without_its_draft_model_drafts_by_lookup_alone_and_equals_plain(hs):
    """``draft_model=False`` (the bench's ``auto-lookup``): auto with a draft loaded but left out sizes its rounds
    without a draft model (no depth, no prior, no probes), drafts from prompt lookup only, never asks the draft
    for a proposal, and still gives the plain output; a fixed chain without the model is refused."""
    prompt = hs.target.tokenize(hs.render([{"role": "user", "content": REPEAT}]), add_special=False)
    hs.reset()
    plain = hs.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    asked = []
    originals = {name: getattr(hs.draft, name) for name in ("propose", "propose_tree", "prefill")}
    for name, fn in originals.items():
        setattr(hs.draft, name, lambda *a, _fn=fn, _name=name, **k: asked.append(_name) or _fn(*a, **k))
    try:
        # lookup pays whatever this machine's curve (where 2 rows cost 2 decodes, 48 tokens of this answer may not)
        with cheap_rows_in(hs):
            assert hs._policy(SpecConfig(draft_len="auto")).max_depth > 0
            assert hs._policy(SpecConfig(draft_len="auto", draft_model=False)).max_depth == 0
            out = hs.generate(prompt, max_new_tokens=48, draft_len="auto", draft_model=False, suffix=False)
    finally:
        for name, fn in originals.items():
            setattr(hs.draft, name, fn)
    assert out.tokens == plain
    drafted = [r for r in out.stats.rounds if r.drafted]
    assert drafted and all(r.source == "lookup" and r.shadow == 0 for r in drafted)
    assert sum(r.bytes_to_draft for r in out.stats.rounds) == 0 and asked == []
    with pytest.raises(HeteroSpecError, match="draft_len 'auto'"):
        hs.generate(prompt, max_new_tokens=8, draft_len=3, draft_model=False)


def test_tree_draft_bench_runs_both_ways_and_both_equal_plain_decoding(model_path, tmp_path):
    """``scripts/bench_tree_draft.py`` (docs/bench.md's tree-draft table) on the shipped darter: greedy trees
    drafted through the native step and through torch, each output equal to plain decoding's, and the figures
    written with the command that reproduces them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "tree.json"
    res = subprocess.run([sys.executable, str(root / "scripts" / "bench_tree_draft.py"), str(model_path),
                          str(root / "drafts" / "smollm2-135m-darter.safetensors"), "--shape", "4,2,2", "--n-prompts",
                          "1", "--max-tokens", "24", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    (row,) = data["trees"]
    assert row["tree"] == {"tokens": 4, "depth": 2, "top_k": 2}
    for way in ("native", "torch"):
        figures = row[way]
        assert figures["runs"] == 2 and figures["equal_to_plain"] == 2  # one mt_bench and one gsm8k prompt
        assert figures["rounds"] > 0 and figures["draft_ms_per_round"] > 0
        assert 1.0 <= figures["mean_accepted_length"] <= 3.0  # at most both levels and the bonus token
    assert "--shape 4,2,2" in data["meta"]["command"] and "tree 4,2,2: native" in res.stdout
