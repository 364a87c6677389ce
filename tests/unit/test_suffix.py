"""The suffix structure: longest matches over the request and past outputs, trees of frequent continuations,
a bounded FIFO cache that persists; and auto's choice of suffix trees by their cost and acceptance."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.calibration import SETTLE_ROUNDS, CostCurve
from hetero_spec.spec.lookup import NgramLookup
from hetero_spec.spec.policy import AutoPolicy, Shape
from hetero_spec.spec.suffix import SEP, SuffixCache, SuffixConfig, SuffixRequest, _best_chain, _best_nodes, prompt_key
from hetero_spec.spec.tree import Tree


def test_the_longest_match_decides_and_its_depth_is_capped_by_the_match_length():
    # (2, 3) continued with 4 and with 9; the longer match (1, 2, 3) only with 9
    text = [1, 2, 3, 9, 8, 7, 5, 2, 3, 4, 4, 1, 2, 3]
    prop = SuffixRequest(text).propose()
    assert prop.match == 3 and prop.chain == [9, 8, 7]  # three tokens matched: three deep at most
    deep = SuffixRequest(text, config=SuffixConfig(depth_factor=2.0)).propose()
    assert deep.chain == [9, 8, 7, 5, 2, 3]
    assert SuffixRequest([1, 2, 3, 4]).propose() is None  # the suffix itself is no match


def test_a_tree_holds_the_frequent_continuations_with_counted_probabilities():
    # after (7, 7): 1 2 twice, 5 6 once, each behind a match of 2 (different tokens before each 7 7)
    flat = SuffixRequest([9, 7, 7, 1, 2, 0, 3, 7, 7, 1, 2, 0, 4, 7, 7, 5, 6, 0, 8, 7, 7],
                         config=SuffixConfig(min_prob=0.2)).propose(tree=True)
    assert flat.match == 2
    chain = SuffixRequest([9, 7, 7, 1, 2, 0, 3, 7, 7, 1, 2, 0, 4, 7, 7, 5, 6, 0, 8, 7, 7],
                          config=SuffixConfig(min_prob=0.2)).propose(tree=False)
    assert chain.chain == [1, 2] and chain.tokens[1:] == [1, 2]  # a chain: the most probable path only
    by_token = dict(zip(flat.tokens[1:], flat.probs[1:]))
    assert by_token[1] == pytest.approx(2 / 3) and by_token[5] == pytest.approx(1 / 3)
    assert flat.sizes() == [0, 2, 4]
    tree = Tree(np.array([0, *flat.tokens[1:]]), np.array(flat.parents))  # a valid tree, parents first
    assert tree.depth.tolist() == flat.depths
    assert flat.truncated(1) == ([-1, 1, 5], [-1, 0, 0])
    # a rare branch below min_prob is left out
    rare = SuffixRequest([9, 7, 7, 1, 0, 3, 7, 7, 1, 0, 4, 7, 7, 1, 0, 5, 7, 7, 1, 0, 6, 7, 7, 2, 0, 8, 7, 7],
                         config=SuffixConfig(min_prob=0.25)).propose(tree=True)
    assert rare.tokens[1:] == [1, 0]


def test_the_node_budget_keeps_the_most_probable_nodes():
    text = []
    for i, cont in enumerate([[1, 2], [1, 2], [1, 3], [4, 5]] * 2):
        text += [9, 7, 7, *cont, 50 + i]
    text += [9, 7, 7]
    prop = SuffixRequest(text, config=SuffixConfig(max_nodes=3, min_prob=0.0)).propose()
    assert prop.tokens[1:] == [1, 4, 2]  # p(1) = 3/4, p(4) = 1/4, p(1, 2) = 1/2 > p(1, 3) = 1/4 ... ties by depth
    assert prop.probs[1:] == pytest.approx([0.75, 0.25, 0.5])


def test_a_single_occurrence_proposes_what_prompt_lookup_does():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 5, 400).tolist()
    lookup = NgramLookup(text, n_min=2, n_max=4)
    cfg = SuffixConfig(occurrences=1, longest=4, max_depth=4, depth_factor=4.0, min_prob=0.0)
    for end in range(20, 400, 13):
        look = NgramLookup(text[:end], n_min=2, n_max=2)
        prop = SuffixRequest(text[:end], config=cfg).propose(tree=False)
        want = look.propose(4)
        assert (prop.chain if prop else []) == want
    assert lookup.tokens == text


def test_a_chain_is_the_most_probable_path_of_the_tree_without_building_it():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):  # continuations over a few tokens, so that they share prefixes and tie
        conts = [[int(t) for t in rng.integers(0, 3, rng.integers(1, 7))] for _ in range(rng.integers(1, 7))]
        min_prob = float(rng.choice([0.0, 0.1, 0.3]))
        depth = int(rng.integers(1, 8))
        tree = _best_nodes(conts, 5, 64, min_prob)
        chain = _best_chain(conts, 5, depth, min_prob)
        if tree is None:
            assert chain is None
            continue
        assert chain.chain == tree.chain and chain.chain_probs == pytest.approx(tree.chain_probs)
        assert chain.tokens[1:] == tree.chain[:depth] and chain.depths == list(range(len(chain.tokens)))
        assert chain.parents == [-1] + list(range(len(chain.tokens) - 1))
        checked += 1
    assert checked > 200


def test_past_outputs_are_matched_but_never_across_their_boundaries():
    cache = SuffixCache(SuffixConfig())
    cache.add("a", [5, 6, 7, 8])
    cache.add("b", [1, 2, 3, 4])
    req = SuffixRequest([0, 0, 5, 6], cache)
    assert req.propose().chain == [7, 8] and req.propose().cached  # 8 ends its output: nothing crosses into "b"
    assert not SuffixRequest([1, 2, 9, 0, 1, 2], cache).propose().cached  # the request's own text matches too
    assert SuffixRequest([0, 8, 1], cache).propose() is None  # "8 1" spans two outputs: no match
    req.extend([7, 8])
    req.finish()  # key None: a new entry, the output after the prompt's last prompt_context tokens
    assert len(cache) == 3 and cache.outputs()[-1][1] == [0, 0, 5, 6, 7, 8]
    short = SuffixCache(SuffixConfig(prompt_context=1))
    done = SuffixRequest([0, 0, 5, 6], short)
    done.extend([7, 8])
    done.finish()
    assert short.outputs()[-1][1] == [6, 7, 8]


def test_a_repeated_prompt_copies_the_past_answer_from_its_first_token():
    prompt, answer = list(range(100, 140)), [7, 3, 9, 4, 1, 8, 2, 6, 5, 0]
    for context, want in ((32, answer[:8]), (0, None)):  # 0: the output alone, which nothing matches yet
        cache = SuffixCache(SuffixConfig(prompt_context=context, max_depth=8))  # the chain cut at max_depth
        first = SuffixRequest(prompt, cache)
        first.extend(answer)
        first.finish()
        prop = SuffixRequest(prompt, cache).propose(tree=False)
        assert (prop.chain if prop else None) == want
        if prop is not None:
            assert prop.cached and prop.match == 32  # the prompt's end, counted back up to ``longest``


def test_a_request_in_flight_lends_its_output_to_a_peer_behind_it():
    prompt = list(range(100, 140))
    ahead, behind = SuffixRequest(prompt), SuffixRequest(prompt)
    ahead.extend([7, 3, 9, 4, 1, 8, 2, 6, 5, 0])
    assert behind.propose(tree=False) is None  # nothing in its own text or a cache
    prop = behind.propose(tree=False, peers=[ahead, behind])
    assert prop.chain == [7, 3, 9, 4, 1, 8, 2, 6, 5, 0] and prop.cached and prop.match == 32
    behind.extend([7, 3])
    assert behind.propose(tree=False, max_depth=4, peers=[ahead]).chain == [9, 4, 1, 8]
    assert ahead.propose(tree=False, peers=[behind]) is None  # the peer behind has not written this text yet


def test_the_cache_is_bounded_in_tokens_and_evicts_the_oldest_first():
    cache = SuffixCache(SuffixConfig(cache_tokens=10))
    for i in range(5):
        cache.add(i, [10 * i + j for j in range(4)])
    assert [k for k, _ in cache.outputs()] == [3, 4] and cache.live == 8
    cache.add(3, [1, 2])  # the same key replaces its output
    assert [k for k, _ in cache.outputs()] == [4, 3] and cache.live == 6
    assert SuffixRequest([7, 40, 41], cache).propose().chain == [42, 43]
    assert SuffixRequest([7, 30, 31], cache).propose() is None  # evicted: its tokens are separators now
    for i in range(200):  # evictions rebuild the index: it stays near the bound
        cache.add(("x", i), [i % 7, 1000 + i])
    assert len(cache.index.tokens) <= 4 * 1024 // 3 + 12 and cache.live <= 10
    assert SEP not in [t for _, out in cache.outputs() for t in out]


def test_a_saved_cache_loads_into_another_process(tmp_path):
    cache = SuffixCache()
    cache.add(prompt_key([1, 2]), [4, 5, 6])
    cache.add("other", [7, 8, 9, 10])
    path = cache.save(tmp_path / "cache.json")
    again = SuffixCache()
    assert again.load(path) == 2
    assert [out for _, out in again.outputs()] == [[4, 5, 6], [7, 8, 9, 10]]
    assert SuffixRequest([3, 7, 8], again).propose().chain == [9, 10]
    assert again.outputs()[0][0] == prompt_key([1, 2])  # the key comes back equal: a rerun replaces it
    (tmp_path / "bad.json").write_text('{"entries": []}')
    with pytest.raises(ValueError, match="not a readable suffix cache"):
        again.load(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        again.load(tmp_path / "missing.json")


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        SuffixConfig(max_nodes=0)
    with pytest.raises(ValueError):
        SuffixConfig(longest=1, key=2)


# ------------------------------------------------------------------ auto's choice
def curve(t1: float = 10.0, slope: float = 2.0) -> CostCurve:
    return CostCurve({n: t1 + slope * (n - 1) for n in range(1, 33)}, 3.0, {n: 3.0 for n in range(1, 33)})


def test_a_suffix_tree_is_chosen_where_it_pays_and_probed_where_it_does_not():
    policy = AutoPolicy(curve(slope=4.0), max_depth=0, suffix_depth=8, probe_every=4, decay=1.0)
    sizes = [0, 1, 3, 4, 5]  # two nodes at depth 2
    # no evidence yet: after a short match in past outputs (prior 0.3) no depth beats plain rounds (1.3 tokens
    # for 1.4 t(1) at depth 1): probes
    shapes = [policy.choose(suffix=sizes, suffix_match=2, suffix_cached=True) for _ in range(8)]
    assert [s.probe for s in shapes].count(True) == 2 and all(s.source == "suffix" for s in shapes if s.depth)
    assert all(s.depth == 1 and s.tokens == 1 for s in shapes if s.depth)
    for _ in range(40):  # long matches in this bucket are accepted all the way
        policy.observe_suffix_chain(5, 4, 4)
    shape = policy.choose(suffix=sizes, suffix_match=5)
    assert shape == Shape(4, 5, 5, source="suffix") and shape.tokens == 5
    # another bucket keeps its own statistics
    assert policy.choose(suffix=sizes, suffix_match=2).depth <= 1
    # no offer: a plain round, never a draft probe (there is no draft model)
    assert all(policy.choose() == Shape(0) for _ in range(300))
    assert not policy.wants_rows(16) and not policy.expects_drafting()


def test_verified_suffix_rounds_teach_the_chosen_bucket_and_its_measured_cost():
    policy = AutoPolicy(curve(), max_depth=0, suffix_depth=8, decay=1.0)
    for _ in range(30):
        policy.observe_suffix_chain(20, 3, 3)
    shape = policy.choose(suffix=[0, 1, 2, 3], suffix_match=20)
    assert shape.depth == 3
    # past outputs alone keep statistics of their own: what they teach leaves the request's own text's alone
    for _ in range(30):
        policy.observe_suffix_chain(20, 3, 0, cached=True)
    assert policy.choose(suffix=[0, 1, 2, 3], suffix_match=20, suffix_cached=True).depth == 0
    assert policy.choose(suffix=[0, 1, 2, 3], suffix_match=20).depth == 3
    for _ in range(10):
        policy.choose(suffix=[0, 1, 2, 3], suffix_match=20)
        policy.observe(3, 0, source="suffix")  # now rejected at once
    assert policy.suffix_buckets[3].alpha(1) < 0.8
    for _ in range(SETTLE_ROUNDS + 2):  # settled plain rounds at the curve's speed
        policy.observe_time(Shape(0), 0, 0.010)
    for _ in range(30):  # suffix rounds measured 4x dearer than the curve says
        policy.observe_time(Shape(3, 3, 3, source="suffix"), 0, 4 * 0.016)
    assert policy.cost.scale("suffix") > 3
    for _ in range(30):
        policy.observe_suffix_chain(20, 3, 3)
    assert policy.choose(suffix=[0, 1, 2, 3], suffix_match=20).depth == 0


def test_a_tree_competes_with_its_most_probable_path_by_the_cost_of_its_rows():
    # "7 7" was followed by 1 2 twice and 5 6 once: the chain 1 2 (2/3), the tree 1.5x as likely to reach each depth
    prop = SuffixRequest([9, 7, 7, 1, 2, 0, 3, 7, 7, 1, 2, 0, 4, 7, 7, 5, 6, 0, 8, 7, 7],
                         config=SuffixConfig(min_prob=0.2)).propose(tree=True)
    assert prop.chain == [1, 2] and prop.boost() == pytest.approx([1.0, 1.5, 1.5])
    chosen = {}
    for slope in (0.5, 6.0):  # rows nearly free (a GPU-like curve), rows a good part of a decode (a CPU's)
        policy = AutoPolicy(curve(slope=slope), max_depth=0, suffix_depth=8, decay=1.0, min_gain=1.0)
        for _ in range(50):
            policy.observe_suffix_chain(2, 2, 1)  # the chain's first token right, its second wrong
            policy.observe_suffix_chain(2, 2, 2)
            policy.observe_suffix_chain(2, 2, 0)
        chosen[slope] = policy.choose(suffix=prop.sizes(), suffix_match=prop.match, suffix_boost=prop.boost())
    assert chosen[0.5].width > 1 and chosen[0.5].tokens == 4  # the whole tree
    assert chosen[6.0].width == 1 or chosen[6.0].depth == 0  # the chain, or nothing


def steep(t1: float = 5.6) -> CostCurve:
    """A CPU whose matrix kernels work in 4-row tiles: 2 rows cost nearly 2 decodes, 4 rows 2.3, 16 rows 5.3
    (SmolLM2 Q4_0 with repacked weights, 2 threads, ``hetero-spec calibrate``)."""
    ratio = {1: 1.0, 2: 1.9, 3: 2.2, 4: 2.3, 5: 2.75, 6: 3.2, 7: 3.7, 8: 3.5, 9: 4.2, 10: 4.45, 11: 5.05, 12: 5.0,
             13: 5.6, 14: 6.1, 15: 6.6, 16: 5.3, 17: 6.1}
    return CostCurve({n: t1 * ratio.get(n, n / 3) for n in range(1, 33)}, 0.3, {n: 0.3 for n in range(1, 33)})


def test_a_long_match_is_copied_deep_from_the_first_round_and_a_short_one_in_past_outputs_waits():
    from hetero_spec.spec.policy import SUFFIX_MATCH_BUCKETS, SUFFIX_PRIOR_ALPHAS

    assert len(SUFFIX_PRIOR_ALPHAS) == 2 * len(SUFFIX_MATCH_BUCKETS)  # a prior for every bucket, own and cached
    policy = AutoPolicy(steep(), max_depth=0, suffix_depth=16)
    sizes, boost = list(range(17)), [1.0] * 17  # one continuation: the tree is the chain
    deep = policy.choose(suffix=sizes, suffix_match=24, suffix_boost=boost)
    assert deep.source == "suffix" and deep.depth >= 7  # 98% a token behind 16+ matched tokens: 8 rows or more
    short = policy.choose(suffix=sizes[:4], suffix_match=2, suffix_boost=boost[:4], suffix_cached=True)
    assert short.depth == 0 or short.probe  # 30% at the first token: not worth a 2-row decode


def test_a_chain_may_run_deeper_than_its_capped_tree():
    policy = AutoPolicy(steep(), max_depth=0, suffix_depth=16)
    sizes = [0, 2, 4, 6, 8, 10, 12]  # two branches to depth 6: the tree's 12 nodes end there
    boost = [1.0] + [1.0] * 16  # the most probable path goes on to depth 16
    shape = policy.choose(suffix=sizes, suffix_match=24, suffix_boost=boost)
    assert shape.width == 1 and shape.depth > 6  # the chain alone, past the tree


def test_the_unverified_rest_of_a_chain_accepted_whole_teaches_the_deeper_depths():
    from hetero_spec.spec.orchestrator import _open_tail
    from hetero_spec.spec.policy import AcceptanceStats
    from hetero_spec.spec.shadow import ShadowChain
    from hetero_spec.spec.suffix import SuffixProposal

    stats = AcceptanceStats(8, decay=0.5)
    stats.observe(3, 3)
    stats.observe(5, 5, first=4)  # depths 4 and 5 alone, added to the round that reached depth 3
    assert stats.reached[1:] == [1, 1, 1, 1, 1, 0, 0, 0] and stats.accepted[1:6] == [1, 1, 1, 1, 1]
    stats.observe(8, 6, first=5)  # reached 5..7, accepted 5 and 6: nothing before 5 forgotten or added
    assert stats.reached[1:] == [1, 1, 1, 1, 2, 1, 1, 0] and stats.accepted[5:8] == [2, 1, 0]

    policy = AutoPolicy(steep(), max_depth=0, suffix_depth=16)
    chain = [10, 11, 12, 13, 14, 15, 16, 17]
    prop = SuffixProposal(tokens=[-1, *chain], parents=list(range(-1, 8)), depths=list(range(9)), probs=[1.0] * 9,
                          match=2, chain=chain, chain_probs=[1.0] * 8, cached=True)
    bucket = policy.suffix_buckets[4]  # past outputs, match 2-3
    before = [bucket.alpha(d) for d in range(1, 9)]
    tail = ShadowChain()
    _open_tail(tail, prop, [10, 11, 99], policy)  # the bonus token left the chain: nothing to check
    assert not tail.guesses
    _open_tail(tail, prop, [10, 11, 12], policy)  # 2 verified rows and the bonus token on the chain
    assert tail.guesses == [13, 14, 15, 16, 17]
    tail.check([13, 14, 15])
    tail.check([16, 0])  # the 5th of the rest left it: depths 4..7 right, depth 8 wrong
    assert not tail.guesses
    after = [bucket.alpha(d) for d in range(1, 9)]
    assert after[:3] == before[:3] and all(a > b for a, b in zip(after[3:7], before[3:7])) and after[7] < before[7]


def test_the_first_use_calibration_times_every_width_a_suffix_round_may_verify():
    from hetero_spec.api import AUTO_SUFFIX_DEPTH, QUICK_ROWS

    # t(n) is not smooth where kernels work in 4-row tiles: an interpolated width would be mispriced
    assert set(range(1, AUTO_SUFFIX_DEPTH + 2)) <= set(QUICK_ROWS)
