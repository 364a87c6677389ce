"""The prompt cache's bookkeeping: which texts it keeps, which entry a prompt gets, and what goes when it is
full (the cells themselves are put back bit for bit in tests/integration/test_engine.py)."""
from __future__ import annotations

import pytest

from hetero_spec.engine.prompt_cache import PromptCache
from hetero_spec.target.llama_target import common_prefix


def cells(n_bytes: int):
    """A ``read_state`` that returns ``n_bytes`` bytes and counts its calls."""
    calls = []

    def read() -> bytes:
        calls.append(1)
        return bytes(n_bytes)

    read.calls = calls
    return read


@pytest.mark.parametrize("a,b,n", [((1, 2, 3), (1, 2, 3), 3), ((1, 2, 3), (1, 2), 2), ((1, 2, 3), (1, 9, 3), 1),
                                   ((), (1,), 0), (tuple(range(100)), tuple(range(57)) + (0,), 57)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n == common_prefix(b, a)
    assert common_prefix(list(a), b) == n  # lists too, and mixed (a slot's cells, LlamaTarget's tokens)


def test_short_texts_and_covered_texts_are_not_saved_nor_read():
    cache = PromptCache(1 << 20, min_tokens=4)
    short = cells(10)
    assert not cache.save([1, 2, 3], short) and not short.calls
    assert cache.save([1, 2, 3, 4, 5, 6], cells(10))
    covered = cells(10)
    assert not cache.save([1, 2, 3, 4], covered) and not covered.calls  # the start of an entry
    assert len(cache) == 1 and cache.bytes == 10


def test_a_longer_text_replaces_the_entries_it_starts_with():
    cache = PromptCache(1 << 20, min_tokens=4)
    cache.save([1, 2, 3, 4], cells(10))
    cache.save([7, 7, 7, 7], cells(20))
    cache.save([1, 2, 3, 4, 5, 6], cells(30))
    assert len(cache) == 2 and cache.bytes == 50
    n, entry = cache.best([1, 2, 3, 4, 5, 6, 8])
    assert n == 6 and entry.tokens == (1, 2, 3, 4, 5, 6)


def test_best_leaves_the_prompts_last_token_and_needs_min_tokens():
    cache = PromptCache(1 << 20, min_tokens=4)
    cache.save([1, 2, 3, 4, 5, 6], cells(10))
    assert cache.best([1, 2, 3, 4, 5, 6])[0] == 5  # the last prompt row is decoded again for its logits
    assert cache.best([1, 2, 3, 9, 9, 9]) == (0, None)  # 3 shared tokens: under min_tokens
    assert cache.best([5, 6]) == (0, None)


def test_full_cache_evicts_least_recently_used_first():
    cache = PromptCache(100, min_tokens=2)
    cache.save([1, 1], cells(40))
    cache.save([2, 2], cells(40))
    cache.best([1, 1, 0])  # a hit: [1, 1] is now the most recent
    cache.save([3, 3], cells(40))  # 120 > 100: the least recent, [2, 2], goes
    assert cache.best([2, 2, 0]) == (0, None)
    assert cache.best([1, 1, 0])[0] == 2 and cache.best([3, 3, 0])[0] == 2
    assert cache.bytes == 80
    assert not cache.save([4, 4], cells(101)) and cache.bytes == 80  # larger than the whole cache: not kept


def test_zero_limit_keeps_nothing_and_negative_is_refused():
    cache = PromptCache(0)
    read = cells(10)
    assert not cache.save(list(range(40)), read) and not read.calls
    with pytest.raises(ValueError):
        PromptCache(-1)
