"""The round loop: draft -> verify -> accept -> rollback, yielding one Round per step.

Only token ids go to the target and only hidden-state rows (with the token ids that
follow them) go to the draft; the target's logits never leave this module.  The loop
is written against two small protocols, so this package imports neither llama.cpp nor
torch: ``api.py`` hands it a concrete target and draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..config import SamplingConfig
from ..records import Round
from .policy import CATCHUP_ROWS, LOOKUP_MATCH_BUCKETS, FixedPolicy, Shape
from .sampling import process_logits, process_support, sample_support
from .lookup import NgramLookup, lookup_evidence
from .shadow import ShadowChain
from .suffix import SuffixCache, SuffixProposal, SuffixRequest, prompt_key
from .tree import Tree
from .verify import greedy_accept, greedy_accept_tree, sample_accept_tree

TOKEN_BYTES = 4  # int32 ids on both sides


class Target(Protocol):
    n_ctx: int
    n_embd: int
    n_vocab: int

    @property
    def n_past(self) -> int: ...
    def prefill(self, tokens: list[int], max_reuse: int | None = None,
                hidden_from: int | None = None) -> tuple[np.ndarray | None, np.ndarray]: ...
    def verify(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]: ...
    def rollback(self, n_keep: int) -> None: ...
    def verify_tree(self, tokens: np.ndarray, depths: np.ndarray, seq_ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]: ...
    def keep_branch(self, seq: int, path_tokens: list[int]) -> None: ...
    def kv_pos_max(self) -> int: ...
    def is_eog(self, token: int) -> bool: ...
    def set_embeddings(self, on: bool) -> None: ...


class Draft(Protocol):
    @property
    def n(self) -> int: ...
    @property
    def max_positions(self) -> int: ...
    def propose(self, features: np.ndarray, tokens: Sequence[int], k: int) -> list[int]: ...
    def propose_tree(self, features: np.ndarray, tokens: Sequence[int], *, top_k: int, total_tokens: int,
                     depth: int, sampling: SamplingConfig | None, rng: np.random.Generator | None,
                     p_min: float): ...  # -> TreeProposal (tokens, parents, q, n_real)
    def rollback(self, n_keep: int) -> None: ...
    def skip(self, n: int) -> None: ...
    def prefill(self, features: np.ndarray, tokens: Sequence[int]) -> None: ...
    def add_context(self, tokens: Sequence[int]) -> int: ...  # tokens of the text, for a reduced head's rows


@dataclass
class Step:
    """Tokens appended to the output by one round (and the round's record; None for the prefill's token)."""

    tokens: list[int]
    round: Round | None
    stop_reason: str = ""  # set on the last step: "eog", "max_tokens", "context_full"


@dataclass
class _Pending:
    """Real target rows the draft has not consumed yet: f_i and x_{i+1} for i = start..

    Plain rounds add one row each; the rows are joined only when the draft consumes them
    (joining every round made a long plain stretch quadratic)."""

    chunks: list[np.ndarray]  # [rows, n_embd] float32 each, owned copies
    next_tokens: list[int] = field(default_factory=list)  # one per row
    holes: int = 0  # positions before the rows that the draft skips when it next consumes them

    @property
    def features(self) -> np.ndarray:
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0]

    def __post_init__(self) -> None:
        self.next_tokens = list(self.next_tokens)  # owned: ``add`` extends it, and callers keep emitting theirs

    def add(self, rows: np.ndarray, tokens: list[int]) -> None:
        self.chunks.append(rows.copy())  # ``rows`` is a view into llama.cpp's buffer
        self.next_tokens.extend(tokens)

    @property
    def positions(self) -> int:
        """Draft positions these rows stand for: the holes before them, then one per row."""
        return self.holes + len(self.next_tokens)

    def trim(self, draft: Draft, keep: int = CATCHUP_ROWS) -> None:
        """Leave only the last ``keep`` rows; the draft skips the older positions (holes).

        Holes are skipped here, when the draft next runs, in one call: a skip per plain round
        cost about 0.1 ms (a torch fill of the hole mask) against a 7 ms round."""
        drop = max(0, len(self.next_tokens) - keep)
        if drop + self.holes:
            draft.skip(self.holes + drop)
            self.holes = 0
        if drop:
            self.chunks = [self.features[drop:]]
            del self.next_tokens[:drop]

    def to_holes(self) -> None:
        """A round decoded without hidden states: its position and every pending row become holes
        (a hole before rows leaves them useless, the draft starts from the newest row)."""
        if self.next_tokens:
            self.holes += len(self.next_tokens)
            self.chunks.clear()
            self.next_tokens.clear()
        self.holes += 1

    def bytes_to_draft(self) -> int:
        width = self.chunks[0].shape[1] * self.chunks[0].itemsize if self.chunks else 0
        return len(self.next_tokens) * (width + TOKEN_BYTES)


class KVMismatch(RuntimeError):
    """Internal invariant broken: the caches no longer describe the accepted text."""


class Policy(Protocol):
    lookup_depth: int  # > 0: the policy takes prompt-lookup proposals of up to this many tokens
    suffix_depth: int  # > 0: ... and suffix-structure trees up to this deep

    def choose(self, lookup: int = 0, match: int = 0, suffix: Sequence[int] = (), suffix_match: int = 0,
               suffix_boost: Sequence[float] = (), suffix_cached: bool = False) -> Shape: ...
    def observe(self, drafted_depth: int, accepted: int, source: str = "draft") -> None: ...
    def observe_shadow(self, source: str, p_accept: float) -> None: ...
    def observe_probe(self, drafted_depth: int, accepted: int) -> None: ...
    def observe_lookup_chain(self, match: int, drafted_depth: int, accepted: int) -> None: ...
    def observe_suffix_chain(self, match: int, drafted_depth: int, accepted: int, cached: bool = False) -> None: ...
    def observe_suffix_tail(self, match: int, cached: bool, first: int, drafted_depth: int, accepted: int) -> None: ...
    def observe_time(self, shape: Shape, rows_consumed: int, seconds: float, kept_row: bool = False) -> None: ...
    def expects_drafting(self) -> bool: ...
    def wants_rows(self, within: int) -> bool: ...


def generate_tokens(
    target: Target,
    draft: Draft | None,
    prompt: list[int],
    *,
    max_new_tokens: int,
    draft_len: int,
    sampling: SamplingConfig | None = None,
    policy: Policy | None = None,
    p_min: float = 0.0,
    suffix: SuffixCache | None = None,
) -> Iterator[Step]:
    """Speculative generation; with ``draft`` None or ``draft_len`` 0, plain decoding (unless a policy
    drafts from prompt lookup or the suffix structure, which need no draft model).

    Greedy chains of a fixed ``draft_len`` take the original chain path.  A ``policy``
    (fixed tree, or auto sizing), sampling (temperature > 0) or ``p_min`` take the tree
    path, of which a chain is the one-branch case.  With sampling the output follows the
    target's processed distribution, reproducibly for a given ``sampling.seed``.

    ``suffix``: the shared cache of past outputs; with a policy whose ``suffix_depth`` > 0 the request
    drafts from a suffix structure over its prompt, its output and that cache (``spec/suffix.py``), and
    its output joins the cache when it ends.
    """
    sampling = sampling or SamplingConfig()
    rng = np.random.default_rng(sampling.seed)
    if draft is None and policy is not None and (policy.lookup_depth or policy.suffix_depth):
        draft = NO_DRAFT  # copy sources need the round loop, not a model
    speculative = draft is not None and (draft_len > 0 or policy is not None)
    target.set_embeddings(speculative)
    # A policy that does not expect to draft soon (auto with a draft that has not been paying)
    # gets no prompt rows at all: with embeddings on, every row of a micro-batch pays the LM
    # head (measured: +7% prefill time for the last 32-row chunk alone; a draft with taps gets
    # its prompt rows without, LlamaTarget.prefill), and the draft would read them.  The draft then
    # has holes over the prompt and catches up from the first generated row.
    lazy = speculative and policy is not None and not policy.expects_drafting()
    hidden_from = len(prompt) if lazy else None
    hidden, logits = target.prefill(prompt, max_reuse=draft.n if speculative and draft is not NO_DRAFT else None,
                                    hidden_from=hidden_from)
    x = _pick(logits, sampling, rng)
    left = max_new_tokens - 1
    stop = _stop_reason(target, x, left)
    yield Step([x], None, stop)
    if stop:
        return
    if not speculative:
        yield from _plain_rounds(target, x, left, sampling, rng)
        return
    keep = len(prompt) - len(hidden)
    draft.rollback(keep)
    real = max(keep, hidden_from or 0)  # first position with a computed feature
    if real > keep:
        draft.skip(real - keep)
    draft.add_context(list(prompt) + [x])  # the prompt's tokens (even those lazy prefill skips) become proposable
    pending = _Pending([hidden[real - keep :].copy()], list(prompt[real + 1 :]) + [x] if real < len(prompt) else [])
    if len(pending.next_tokens) > CATCHUP_ROWS:
        # The prefill computed these prompt rows for the draft on purpose (a lazy one skips them): the
        # draft consumes them now, in one batched forward, so that the first round's catch-up cap,
        # meant for rows piled up by plain rounds, never turns the prompt into holes.
        draft.prefill(pending.features[:-1], pending.next_tokens[:-1])
        pending = _Pending([pending.features[-1:]], pending.next_tokens[-1:])
    general = policy is not None or not sampling.greedy or p_min > 0
    if general and policy is None:
        policy = FixedPolicy(Shape(draft_len))
    lookup = NgramLookup(list(prompt) + [x]) if general and policy.lookup_depth else None
    sfx = SuffixRequest(prompt, suffix, key=prompt_key(prompt)) if general and policy.suffix_depth else None
    if sfx is not None:
        sfx.extend([x])  # the output starts with the prefill's token: it joins the cache with the rest
    shadow = ShadowChain()  # a draft probe's chain
    lookup_shadow = ShadowChain()  # a prompt-lookup proposal that no round verified
    tail_shadow = ShadowChain()  # the unverified rest of a suffix chain whose verified part was accepted whole
    text = _HeldText(draft)
    try:
        while True:
            if general:
                offered, match = (lookup.propose_matched(policy.lookup_depth, longest=LOOKUP_MATCH_BUCKETS[-1])
                                  if lookup is not None else ([], 0))
                if sfx is None:
                    shape = policy.choose(len(offered), match)
                else:  # the suffix structure replaces prompt lookup as the copy source (it covers its proposals)
                    tree = sfx.propose(tree=sampling.greedy, max_depth=policy.suffix_depth)
                    shape = (policy.choose(0, 0, tree.sizes(), tree.match, tree.boost(), tree.cached) if tree else
                             policy.choose(0, 0, (), 0))
                    offered, match = (tree.chain, tree.match) if tree else ([], 0)
                # greedy rounds check an offer nobody verifies through ``lookup_shadow``, not in the round
                if shape.depth == 0 and (sampling.greedy or not offered) and not policy.wants_rows(CATCHUP_ROWS):
                    step, x = _quiet_round(target, x, pending, policy, sampling, rng, left)
                else:
                    if shape.depth and shape.source == "draft":  # the draft may run: it needs the whole text
                        text.flush()
                    step, x, pending = _tree_round(target, draft, x, pending, policy, sampling, rng, p_min, left,
                                                   lookup, shadow, offered, shape, tree if sfx else None)
                source = "suffix" if sfx else "lookup"
                if offered and sampling.greedy and not lookup_shadow.guesses and _unverified(step, source):
                    lookup_shadow.open(offered, partial(policy.observe_suffix_chain, match, cached=tree.cached) if sfx
                                       else partial(policy.observe_lookup_chain, match))
                if shadow.guesses:
                    shadow.check(step.tokens)
                if lookup_shadow.guesses:
                    lookup_shadow.check(step.tokens)
                if tail_shadow.guesses:
                    tail_shadow.check(step.tokens)
                if not tail_shadow.guesses and sfx is not None and sampling.greedy and not step.stop_reason \
                        and step.round is not None and step.round.source == "suffix":
                    _open_tail(tail_shadow, tree, step.tokens, policy)
            else:
                text.flush()
                step, x, pending = _spec_round(target, draft, x, pending, draft_len, left)
            left -= len(step.tokens)
            text.held.extend(step.tokens)
            if lookup is not None:
                lookup.extend(step.tokens)
            if sfx is not None:
                sfx.extend(step.tokens)
            if step.stop_reason:
                text.flush()
                shadow.close()
                lookup_shadow.close()
                tail_shadow.close()
            yield step
            if step.stop_reason:
                return
    finally:
        text.flush()  # a caller that stops early still leaves the draft the whole text
        if sfx is not None:
            sfx.finish()  # the output (whole or cut short) serves later requests


def suffix_evidence(chain: list[int], drafted: int, path: int, on_chain: int, bonus: int,
                    greedy: bool) -> tuple[int, int]:
    """(drafted depth, accepted) that a verified suffix round teaches the statistics of its most probable path
    ``chain``: the round's tree reached depth ``drafted``, its accepted path ``path`` deep, the first
    ``on_chain`` of those on the chain.  Where the path stayed on the chain, a greedy round also checks the
    chain's next token against the ``bonus`` token, whether or not the tree held it (a capped tree may leave
    it out for a likelier branch elsewhere: prompt lookup's rule, ``lookup_evidence``, at the path's depth); where
    the path left the chain, the chain's token there lost."""
    if greedy and on_chain == path:
        return lookup_evidence(chain, path, path, bonus, greedy)  # at the chain's end: (path, path)
    return drafted, on_chain


def _open_tail(tail: ShadowChain, prop: SuffixProposal, emitted: list[int], policy: Policy) -> None:
    """Check the rest of ``prop``'s chain against the next tokens where a suffix round emitted its chain's
    first tokens (every verified row and the bonus token agreed with it): auto learns the depths past what
    it verified (``observe_suffix_tail``)."""
    n = len(emitted)
    rest = prop.chain[n : policy.suffix_depth]
    if rest and prop.chain[:n] == emitted:
        tail.open(rest, partial(policy.observe_suffix_tail, prop.match, prop.cached, n + 1))


def _unverified(step: Step, source: str) -> bool:
    """Whether the round that made ``step`` verified no proposal of ``source`` (False with no round)."""
    return step.round is not None and step.round.source != source


@dataclass
class _HeldText:
    """Emitted tokens the draft's context head has not been given yet (``Draft.add_context``).

    The head only matters when the draft runs, so tokens wait here through plain rounds and
    reach it in one call before the next round that may draft: a call per plain round cost about
    20 us of a SmolLM2 Q4_0 round (cache-cold after the decode), against 1 us warm."""

    draft: Draft
    held: list[int] = field(default_factory=list)

    def flush(self) -> None:
        if self.held:
            self.draft.add_context(self.held)
            self.held = []


def _pick(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> int:
    """The target's own token from one row: argmax, or a draw from the processed distribution."""
    return _pick_and_check(logits, sampling, rng, None)[0]


def _pick_and_check(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator,
                    guess: int | None) -> tuple[int, float]:
    """``_pick``, plus the probability that verification would have accepted ``guess`` as a
    deterministic proposal for this row: greedy, whether it is the picked token; sampling, its
    processed probability p(guess), the unbiased evidence.  0.0 without a guess."""
    if sampling.greedy:
        nxt = int(np.argmax(logits))
        return nxt, float(nxt == guess)
    ids, probs = process_support(logits, sampling)
    nxt = sample_support(ids, probs, rng)
    return nxt, float(probs[ids == guess].sum()) if guess is not None else 0.0


def _tree_round(
    target, draft, x: int, pending: _Pending, policy: Policy, sampling: SamplingConfig,
    rng: np.random.Generator, p_min: float, left: int, lookup: NgramLookup | None,
    shadow: ShadowChain | None, offered: list[int], shape: Shape, suffix: SuffixProposal | None = None,
) -> tuple[Step, int, _Pending]:
    """One round of the ``shape`` the policy chose: a plain row, a prompt-lookup chain, a shadow
    probe, or a draft tree (a chain is one branch) verified in one decode, accepted, its path kept.
    ``offered``: what prompt lookup proposed this round (the policy chose knowing its length);
    ``suffix``: the suffix structure's tree this round, where it replaces prompt lookup."""
    t0 = time.perf_counter()
    n0 = target.n_past
    room_target = target.n_ctx - n0 - 1
    if room_target < 0:
        return Step([], None, "context_full"), x, pending
    offered_by = "suffix" if suffix is not None else "lookup"
    if shape.source == "suffix":
        depth = max(0, min(shape.depth, left - 1, room_target))
        if depth and suffix is not None:
            return _suffix_round(target, draft, x, suffix, depth, room_target, pending, policy, sampling, rng, left, t0,
                                 chain=shape.width == 1)
        return _undrafted_round(target, x, pending, policy, sampling, rng, left, t0, offered, offered_by)
    if shape.source == "lookup":
        depth = max(0, min(shape.depth, len(offered), left - 1, room_target))
        if depth:
            return _lookup_round(target, x, offered, depth, pending, policy, sampling, rng, left, t0)
        return _undrafted_round(target, x, pending, policy, sampling, rng, left, t0, offered)
    room_draft = draft.max_positions - draft.n - pending.positions
    depth = max(0, min(shape.depth, left - 1))
    total = max(0, min(shape.tokens, room_target, room_draft))
    m = len(pending.next_tokens)
    if depth == 0 or total == 0 or m == 0:  # m = 0: a lazy prefill gave the draft nothing to start from yet
        return _undrafted_round(target, x, pending, policy, sampling, rng, left, t0, offered, offered_by)
    if shape.probe and shape.width == 1 and sampling.greedy and shadow is not None and not shadow.guesses:
        return _shadow_probe_round(target, draft, x, pending, policy, sampling, rng, left, offered, shadow,
                                   min(depth, total))
    pending.trim(draft)
    m = len(pending.next_tokens)
    td = time.perf_counter()
    prop = draft.propose_tree(pending.features, pending.next_tokens, top_k=shape.width, total_tokens=total,
                              depth=depth, sampling=sampling, rng=rng, p_min=p_min)
    draft_s = time.perf_counter() - td
    tokens = prop.tokens.copy()
    tokens[0] = x
    tree = Tree(tokens, prop.parents)
    path, nxt, rows, hidden, verify_s = _verify_tree(target, tree, lambda i: prop.q[i], sampling, rng)
    draft.rollback(prop.n_real)
    accepted = [int(t) for t in tree.tokens[path]] + [nxt]
    new_pending = _Pending([hidden], accepted)
    _check_kv(target, n0 + len(rows))
    policy.observe(max(1, int(tree.depth.max())), len(path))  # a p-min stop counts as a rejection
    policy.observe_time(shape, m, time.perf_counter() - t0)
    emitted, stop = _truncate_at_stop(target, accepted, left)
    rnd = Round(
        drafted=tree.n - 1, accepted=len(path), emitted=len(emitted), draft_s=draft_s, verify_s=verify_s,
        overhead_s=time.perf_counter() - t0 - draft_s - verify_s,
        bytes_to_target=TOKEN_BYTES * tree.n,
        bytes_to_draft=pending.bytes_to_draft(),
        levels=1 + prop.depth_forwards if tree.n > 1 else 0,
        draft_rows=prop.forwarded_rows if tree.n > 1 and shape.width > 1 else 0,  # a chain's forwards are its steps
    )
    return Step(emitted, rnd, stop), nxt, new_pending


def _verify_tree(target, tree: Tree, q_at, sampling: SamplingConfig, rng: np.random.Generator):
    """One decode of the tree, acceptance, and the accepted branch kept in the target's cache.

    ``q_at(node)``: the distribution the node's children were drawn from (sampling only).
    Returns (accepted nodes, next token, rows kept, their hidden states (a copy), verify seconds)."""
    target.set_embeddings(True)  # every row an output; plain rounds may have turned it off
    tv = time.perf_counter()
    logits, hidden = target.verify_tree(tree.tokens, tree.depth, tree.seq_ids)
    verify_s = time.perf_counter() - tv
    if sampling.greedy:
        path, nxt = greedy_accept_tree(tree.children, tree.tokens, logits.argmax(axis=1))
    else:
        path, nxt = sample_accept_tree(
            tree.children, tree.tokens, lambda i: process_logits(logits[i], sampling), q_at, rng
        )
    rows = [0, *path]
    kept = hidden[rows]  # fancy indexing copies out of llama.cpp's buffer
    target.keep_branch(tree.seq_of(rows[-1]), [int(t) for t in tree.tokens[rows]])
    return path, nxt, rows, kept, verify_s


def _fixed_proposal_q(tree: Tree, n_vocab: int):
    """q for a proposal drawn without a model (prompt lookup, the suffix structure): one-hot on the
    node's first child, so acceptance is p(token) and a rejection draws from p without it."""

    def one_hot(i: int) -> np.ndarray:
        q = np.zeros(n_vocab, dtype=np.float64)
        q[tree.tokens[tree.children[i][0]]] = 1.0
        return q

    return one_hot


def _lookup_round(target, x: int, offered: list[int], depth: int, pending: _Pending, policy: Policy,
                  sampling: SamplingConfig, rng: np.random.Generator, left: int, t0: float) -> tuple[Step, int, _Pending]:
    """The first ``depth`` tokens prompt lookup ``offered``, verified like a drafted chain; the draft
    model does not run and catches up on the kept rows the next time it drafts.  For sampling, the
    proposal is a deterministic draw (q one-hot), so acceptance is p(token) and a rejection draws
    from p without it.  Greedy rounds that accept everything check the next offered token against
    the bonus token for free, so the statistics learn one depth beyond what was verified."""
    n0 = target.n_past
    proposal = offered[:depth]
    tree = Tree.chain(x, proposal)

    path, nxt, rows, hidden, verify_s = _verify_tree(target, tree, _fixed_proposal_q(tree, target.n_vocab),
                                                     sampling, rng)
    accepted = [int(t) for t in tree.tokens[path]] + [nxt]
    pending.add(hidden, accepted)
    _check_kv(target, n0 + len(rows))
    shape = Shape(depth, source="lookup")
    policy.observe(*lookup_evidence(offered, depth, len(path), nxt, sampling.greedy), source="lookup")
    policy.observe_time(shape, 0, time.perf_counter() - t0)
    emitted, stop = _truncate_at_stop(target, accepted, left)
    rnd = Round(drafted=len(proposal), accepted=len(path), emitted=len(emitted), draft_s=0.0, verify_s=verify_s,
                overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES * tree.n,
                bytes_to_draft=0, source="lookup")
    return Step(emitted, rnd, stop), nxt, pending


def _suffix_round(target, draft, x: int, prop: SuffixProposal, depth: int, room: int, pending: _Pending,
                  policy: Policy, sampling: SamplingConfig, rng: np.random.Generator, left: int,
                  t0: float, chain: bool = False) -> tuple[Step, int, _Pending]:
    """The suffix structure's proposal cut at ``depth`` (at most ``room`` nodes), verified in one decode:
    its most probable path where the policy chose a chain (``chain``: ``Shape.width`` 1), else its tree.
    Sampled proposals are always the chain, a deterministic one (q one-hot, as for prompt lookup:
    recursive rejection over several fixed siblings would need a q per sibling)."""
    n0 = target.n_past
    if chain:
        tree = Tree.chain(x, prop.chain[: min(depth, room)])
    else:
        tokens, parents = prop.truncated(depth)
        tokens[0] = x
        if len(tokens) - 1 > room:  # parents come first, so a prefix of the nodes is still a tree
            tokens, parents = tokens[: room + 1], parents[: room + 1]
        tree = Tree(np.array(tokens), np.array(parents))

    path, nxt, rows, hidden, verify_s = _verify_tree(target, tree, _fixed_proposal_q(tree, target.n_vocab),
                                                     sampling, rng)
    accepted = [int(t) for t in tree.tokens[path]] + [nxt]
    if draft is NO_DRAFT:
        pending.to_holes()
    else:
        pending.add(hidden, accepted)
    _check_kv(target, n0 + len(rows))
    # The statistics are the chain's: what the most probable path would have accepted (a sibling accepted
    # at depth j means the chain's node there was rejected).
    drafted = int(tree.depth.max())
    on_chain = 0
    while on_chain < min(len(path), len(prop.chain)) and accepted[on_chain] == prop.chain[on_chain]:
        on_chain += 1
    policy.observe(*suffix_evidence(prop.chain, drafted, len(path), on_chain, nxt, sampling.greedy), source="suffix")
    policy.observe_time(Shape(depth, tree.n - 1, tree.n - 1, source="suffix"), 0, time.perf_counter() - t0)
    emitted, stop = _truncate_at_stop(target, accepted, left)
    rnd = Round(drafted=tree.n - 1, accepted=len(path), emitted=len(emitted), draft_s=0.0, verify_s=verify_s,
                overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES * tree.n,
                bytes_to_draft=0, source="suffix")
    return Step(emitted, rnd, stop), nxt, pending


class _NoDraft:
    """The Draft protocol with no model behind it: what the loop holds when only copy sources draft
    (prompt lookup, the suffix structure).  Its rows are never wanted, so every position is a hole."""

    n = 0
    max_positions = 1 << 30

    def propose(self, features, tokens, k):
        raise RuntimeError("no draft model")

    propose_tree = propose

    def rollback(self, n_keep: int) -> None:
        pass

    def skip(self, n: int) -> None:
        pass

    def prefill(self, features, tokens) -> None:
        pass

    def add_context(self, tokens) -> int:
        return 0


NO_DRAFT = _NoDraft()


def _shadow_probe_round(target, draft, x: int, pending: _Pending, policy: Policy, sampling: SamplingConfig,
                        rng: np.random.Generator, left: int, offered: list[int], shadow: ShadowChain,
                        depth: int) -> tuple[Step, int, _Pending]:
    """A greedy probe without verification rows: the draft proposes ``depth`` tokens and the
    target's own next tokens, from this plain round on, say how many would have been accepted
    (``ShadowChain``).  A verified probe cost about 2.4 plain rounds on SmolLM2 Q4_0 (two-row
    decode right after the draft ran) for 1.7 tokens; this one costs the draft forwards."""
    td = time.perf_counter()
    pending.trim(draft)
    guesses = draft.propose(pending.features, pending.next_tokens, depth)
    draft.rollback(draft.n - (depth - 1))  # the drafted tokens' cells: only real rows stay
    draft_s = time.perf_counter() - td
    shadow.open(guesses, policy.observe_probe)
    consumed = _Pending([pending.features[:0]], [])  # the draft holds these rows now
    step, nxt, new_pending = _undrafted_round(target, x, consumed, policy, sampling, rng, left, time.perf_counter(),
                                              offered)
    rnd = replace(step.round, draft_s=draft_s, bytes_to_draft=pending.bytes_to_draft(), shadow=depth)
    return Step(step.tokens, rnd, step.stop_reason), nxt, new_pending


PLAIN = Shape(0)


def _quiet_round(target, x: int, pending: _Pending, policy: Policy, sampling: SamplingConfig,
                 rng: np.random.Generator, left: int) -> tuple[Step, int]:
    """A plain round with nothing to learn from, auto's usual round where drafting does not pay: one
    target row with embeddings off, no prompt-lookup offer to check in the round (greedy offers are
    checked by the loop), no row for the draft (its position becomes a hole in ``pending``, changed
    in place).

    It does the least it can because after a decode every Python line runs cache-cold: on SmolLM2
    Q4_0 (2 threads, 5.7 ms a token) the general undrafted path's bookkeeping cost about 0.19 ms a
    round against 0.05 ms for the raw loop's argmax.  The KV check is left out: a one-token decode
    through llama_batch_get_one appends at the end of the cache and rolls nothing back."""
    t0 = time.perf_counter()
    if target.n_past >= target.n_ctx:
        return Step([], None, "context_full"), x
    target.set_embeddings(False)
    logits, _ = target.verify([x])
    verify_s = time.perf_counter() - t0
    nxt = int(logits[0].argmax()) if sampling.greedy else _pick(logits[0], sampling, rng)
    pending.to_holes()
    policy.observe_time(PLAIN, 0, time.perf_counter() - t0)
    stop = _stop_reason(target, nxt, left - 1)
    rnd = Round(drafted=0, accepted=0, emitted=1, draft_s=0.0, verify_s=verify_s,
                overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES, bytes_to_draft=0)
    return Step([nxt], rnd, stop), nxt


def _undrafted_round(target, x: int, pending: _Pending, policy: Policy, sampling: SamplingConfig,
                     rng: np.random.Generator, left: int, t0: float, offered: list[int] = (),
                     offered_by: str = "lookup") -> tuple[Step, int, _Pending]:
    """Depth 0 inside the speculative loop: one target row; the draft catches up on it later.

    Unless the policy wants the row soon (``Policy.wants_rows``), the decode runs with embeddings
    off, like plain decoding, and the position and every row still pending become holes (a hole
    before them leaves them useless: the draft starts from the newest row).

    ``offered``: a prompt-lookup (or, ``offered_by``, suffix) proposal nobody verified.  Sampling: its first token is checked
    against this row for free evidence for the lookup statistics (the probability that verification
    would have accepted it); greedy proposals are checked whole by the loop (``ShadowChain``)."""
    n0 = target.n_past
    target.set_embeddings(policy.wants_rows(CATCHUP_ROWS))
    tv = time.perf_counter()
    logits, hidden = target.verify([x])
    verify_s = time.perf_counter() - tv
    nxt, p_offered = _pick_and_check(logits[0], sampling, rng, offered[0] if offered else None)
    if hidden is None:  # this position and every pending row become holes, skipped when the draft next runs
        pending.to_holes()
    else:
        pending.add(hidden[:1], [nxt])
    _check_kv(target, n0 + 1)
    if offered and not sampling.greedy:  # greedy: the loop checks the whole proposal (ShadowChain)
        policy.observe_shadow(offered_by, p_offered)
    policy.observe_time(PLAIN, 0, time.perf_counter() - t0, kept_row=hidden is not None)
    emitted, stop = _truncate_at_stop(target, [nxt], left)
    rnd = Round(drafted=0, accepted=0, emitted=len(emitted), draft_s=0.0, verify_s=verify_s,
                overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES, bytes_to_draft=0)
    return Step(emitted, rnd, stop), nxt, pending


def _spec_round(
    target: Target, draft: Draft, x: int, pending: _Pending, draft_len: int, left: int
) -> tuple[Step, int, _Pending]:
    t0 = time.perf_counter()
    n0 = target.n_past
    room_target = target.n_ctx - n0 - 1  # cells left after x itself
    room_draft = draft.max_positions - draft.n - len(pending.next_tokens) + 1
    k = max(0, min(draft_len, left - 1, room_target, room_draft))
    if room_target < 0:
        return Step([], None, "context_full"), x, pending
    draft_s = 0.0
    drafts: list[int] = []
    if k > 0:
        pending.trim(draft)
        td = time.perf_counter()
        drafts = draft.propose(pending.features, pending.next_tokens, k)
        draft_s = time.perf_counter() - td
    tv = time.perf_counter()
    logits, hidden = target.verify([x, *drafts])
    verify_s = time.perf_counter() - tv
    a, nxt = greedy_accept(drafts, logits.argmax(axis=1))
    accepted = drafts[:a] + [nxt]
    target.rollback(n0 + 1 + a)
    d_real = draft.n - (k - 1 if k > 0 else 0)  # cells from real rows only
    if k > 0:
        draft.rollback(d_real)
        new_pending = _Pending([hidden[: a + 1].copy()], accepted)
    else:  # nothing drafted: the pending rows still wait, plus this row
        pending.add(hidden[:1], accepted)
        new_pending = pending
    _check_kv(target, n0 + 1 + a)
    emitted, stop = _truncate_at_stop(target, accepted, left)
    rnd = Round(
        drafted=k,
        accepted=a,
        emitted=len(emitted),
        draft_s=draft_s,
        verify_s=verify_s,
        overhead_s=time.perf_counter() - t0 - draft_s - verify_s,
        bytes_to_target=TOKEN_BYTES * (k + 1),
        bytes_to_draft=pending.bytes_to_draft() if k else 0,
        levels=k,
    )
    return Step(emitted, rnd, stop), nxt, new_pending


def _plain_rounds(
    target: Target, x: int, left: int, sampling: SamplingConfig | None = None, rng: np.random.Generator | None = None
) -> Iterator[Step]:
    """Plain decoding through the same target: one token per decode, last-row logits only."""
    sampling = sampling or SamplingConfig()
    while True:
        t0 = time.perf_counter()
        if target.n_past + 1 > target.n_ctx:
            yield Step([], None, "context_full")
            return
        logits, _ = target.verify([x])
        verify_s = time.perf_counter() - t0
        x = int(logits[-1].argmax()) if sampling.greedy else _pick(logits[-1], sampling, rng)
        left -= 1
        stop = _stop_reason(target, x, left)
        rnd = Round(
            drafted=0, accepted=0, emitted=1, draft_s=0.0, verify_s=verify_s,
            overhead_s=time.perf_counter() - t0 - verify_s, bytes_to_target=TOKEN_BYTES, bytes_to_draft=0,
        )
        yield Step([x], rnd, stop)
        if stop:
            return


def _truncate_at_stop(target: Target, tokens: list[int], left: int) -> tuple[list[int], str]:
    """A round's emitted tokens up to the first that ends the generation.  Called with the round's rows kept,
    so ``tokens[i]`` is the pick after row ``target.n_past - len(tokens) + i``: each is judged with the cells
    plain decoding would hold when it picked it.  (Judged with the round's final count, a round that filled
    the context cut its accepted tokens short of plain decoding's at the end of the context.)"""
    base = target.n_past - len(tokens)
    for i, tok in enumerate(tokens):
        reason = _stop_reason(target, tok, left - i - 1, n_past=base + i + 1)
        if reason:
            return tokens[: i + 1], reason
    return tokens, ""


def _stop_reason(target: Target, token: int, left_after: int, n_past: int | None = None) -> str:
    """Why the generation ends after ``token`` ("" if it goes on); ``n_past``: the cells held when it was picked
    (default: the target's now)."""
    if target.is_eog(token):
        return "eog"
    if left_after <= 0:
        return "max_tokens"
    if (target.n_past if n_past is None else n_past) + 1 > target.n_ctx:
        return "context_full"
    return ""


def _check_kv(target: Target, expected: int) -> None:
    if target.n_past != expected or target.kv_pos_max() != expected - 1:
        raise KVMismatch(
            f"target KV holds {target.n_past} tokens (max pos {target.kv_pos_max()}), expected {expected}"
        )
