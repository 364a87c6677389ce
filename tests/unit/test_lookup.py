"""Prompt lookup: the longest earlier match of the suffix, its latest occurrence, never the suffix itself."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_spec.spec.lookup import NgramLookup, lookup_evidence


def test_longest_match_wins_then_shorter_ones():
    text = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurred at the start, followed by 9 9 5; (2, 3) alone last continued with 7
    assert NgramLookup(text, n_min=2, n_max=3).propose(3) == [9, 9, 5]
    assert NgramLookup(text, n_min=2, n_max=2).propose(2) == [7, 7]


def test_latest_occurrence_and_no_match():
    assert NgramLookup([4, 5, 1, 4, 5, 2, 4, 5], n_min=2, n_max=2).propose(1) == [2]
    assert NgramLookup([1, 2, 3, 4], n_min=2, n_max=3).propose(2) == []  # the suffix itself is no match
    assert NgramLookup([1, 2], n_min=2).propose(2) == []


def test_proposals_stop_at_the_end_of_the_text():
    look = NgramLookup([8, 9, 8], n_min=1, n_max=1)
    assert look.propose(4) == [9, 8]


def test_incremental_extension_equals_building_at_once():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 6, 300).tolist()
    once = NgramLookup(text, n_min=1, n_max=4)
    step = NgramLookup(text[:10], n_min=1, n_max=4)
    for i in range(10, 300, 7):
        step.extend(text[i : i + 7])
    assert step.tokens == once.tokens and step._next == once._next
    for k in (1, 3):
        assert step.propose(k) == once.propose(k)


def test_bad_ngram_bounds_are_refused():
    with pytest.raises(ValueError):
        NgramLookup([], n_min=3, n_max=2)


def test_match_length_counts_back_past_the_indexed_ngrams():
    text = [7, 1, 2, 3, 4, 5, 6, 9, 8, 0, 1, 2, 3, 4, 5, 6]
    look = NgramLookup(text, n_min=2, n_max=3)
    assert look.propose_matched(2) == ([9, 8], 6)  # 1..6 repeats: six tokens, though only 3-grams are indexed
    assert look.propose_matched(2, longest=4) == ([9, 8], 4)
    assert NgramLookup([5, 1, 2, 9, 6, 1, 2], n_min=2, n_max=3).propose_matched(1) == ([9], 2)
    assert NgramLookup([1, 2, 3], n_min=2).propose_matched(1) == ([], 0)
    # the earlier occurrence starts the text: counting back stops at its first token
    assert NgramLookup([1, 2, 3, 4, 9, 1, 2, 3, 4], n_min=2, n_max=2).propose_matched(1) == ([9], 4)
    # periodic text: the latest occurrence overlaps the suffix, and the match runs back to the start
    assert NgramLookup([5, 6, 5, 6, 5, 6], n_min=2, n_max=2).propose_matched(3) == ([5, 6], 4)


def test_a_greedy_chain_accepted_whole_checks_one_more_offered_token_against_the_bonus():
    offered = [4, 5, 6]
    assert lookup_evidence(offered, 2, 2, 6, greedy=True) == (3, 3)  # the bonus equals the third offer
    assert lookup_evidence(offered, 2, 2, 9, greedy=True) == (3, 2)
    assert lookup_evidence(offered, 2, 1, 6, greedy=True) == (2, 1)  # a rejection: nothing beyond it
    assert lookup_evidence(offered, 3, 3, 6, greedy=True) == (3, 3)  # nothing more was offered
    assert lookup_evidence(offered, 2, 2, 6, greedy=False) == (2, 2)  # sampled bonus: no evidence
