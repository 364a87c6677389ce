"""ShadowChain: a proposal settled by the tokens that follow, whatever rounds emit them."""
from __future__ import annotations

from hetero_spec.spec.shadow import ShadowChain


def test_settles_at_the_first_wrong_token_with_its_full_depth():
    got = []
    chain = ShadowChain()
    chain.open([5, 6, 7], lambda d, a: got.append((d, a)))
    chain.check([5])  # one round's token
    chain.check([6, 9, 1])  # a round that emitted three
    assert got == [(3, 2)] and not chain.guesses
    chain.check([7])  # settled chains take no more tokens
    assert got == [(3, 2)]


def test_settles_when_every_token_was_right_and_ignores_the_rest():
    got = []
    chain = ShadowChain()
    chain.open([1, 2], lambda d, a: got.append((d, a)))
    chain.check([1, 2, 3, 4])
    assert got == [(2, 2)]


def test_close_reports_only_the_depths_that_were_checked():
    got = []
    chain = ShadowChain()
    chain.open([1, 2, 3, 4], lambda d, a: got.append((d, a)))
    chain.check([1, 2])
    chain.close()  # the generation ended: depths 3 and 4 were never checked
    assert got == [(2, 2)]
    chain.open([8, 9], lambda d, a: got.append((d, a)))
    chain.close()  # nothing checked: nothing to report
    assert got == [(2, 2)] and not chain.guesses
