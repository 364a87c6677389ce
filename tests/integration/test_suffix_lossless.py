"""The suffix structure on the real GGUF: greedy output equals plain decoding, with and without a draft model."""
from __future__ import annotations

import pytest

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.spec.orchestrator import generate_tokens
from hetero_spec.spec.policy import FixedPolicy, Shape
from hetero_spec.spec.suffix import SuffixCache, SuffixConfig

N_NEW = 48
GROUNDED = bench_prompts("grounded", 2)
REPEAT = "Repeat this sentence three times: the quick brown fox jumps over the lazy dog."
PROMPTS = [REPEAT, *GROUNDED, *bench_prompts("agentic", 1), *bench_prompts("humaneval", 1)]


@pytest.fixture(scope="module")
def bare(model_path):
    """The target with no draft model at all."""
    from hetero_spec.api import HeteroSpec

    with HeteroSpec(model_path, None, n_ctx=2048) as h:
        yield h


@pytest.fixture(scope="module")
def plain(bare) -> dict[str, list[int]]:
    return {p: bare.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=0).tokens for p in PROMPTS}


class SuffixWhenOffered(FixedPolicy):
    """Verifies the suffix structure's whole tree whenever it offers one, else a plain round."""

    suffix_depth = 8

    def __init__(self) -> None:
        super().__init__(Shape(0))
        self.observed: list[tuple[int, int, str]] = []
        self.branched = 0  # trees with more nodes than levels

    def choose(self, lookup=0, match=0, suffix=(), suffix_match=0, suffix_boost=(), suffix_cached=False) -> Shape:
        d = len(suffix) - 1
        self.branched += d > 0 and suffix[d] > d
        return Shape(d, suffix[d], suffix[d], source="suffix") if d > 0 else Shape(0)

    def observe(self, drafted_depth: int, accepted: int, source: str = "draft") -> None:
        self.observed.append((drafted_depth, accepted, source))


def test_every_offered_suffix_tree_verified_gives_the_plain_output(bare, plain):
    """Trees with branches, accepted partly or whole, on the real target, with no draft model: the plain
    output; the cache of past outputs takes part (each prompt sees the earlier ones' outputs)."""
    cache = SuffixCache(SuffixConfig(min_prob=0.05))
    branched = 0
    observed = []
    for p in PROMPTS:
        prompt = bare.target.tokenize(bare.render([{"role": "user", "content": p}]), add_special=False)
        bare.target.reset()
        policy = SuffixWhenOffered()
        steps = list(generate_tokens(bare.target, None, prompt, max_new_tokens=N_NEW, draft_len=1, policy=policy,
                                     suffix=cache))
        assert [t for s in steps for t in s.tokens] == plain[p], f"diverged on {p[:50]!r}"
        rounds = [s.round for s in steps if s.round and s.round.drafted]
        assert all(r.source == "suffix" for r in rounds)
        branched += policy.branched
        observed += policy.observed
    assert len(cache) == len(PROMPTS)  # every output joined the cache
    accepted = {a for _, a, _ in observed}
    assert 0 in accepted and max(accepted) >= 3, f"acceptance lengths exercised: {accepted}"
    assert branched > 0  # some trees had more nodes than depth: branches were verified


class ShortChains(FixedPolicy):
    """Verifies the first token of the suffix structure's chain whenever it offers 3 or more; records what the
    loop reports of the chain's unverified rest (``observe_suffix_tail``)."""

    suffix_depth = 8

    def __init__(self) -> None:
        super().__init__(Shape(0))
        self.tails: list[tuple[int, int, int]] = []  # (first depth, tokens checked, of them right)

    def choose(self, lookup=0, match=0, suffix=(), suffix_match=0, suffix_boost=(), suffix_cached=False) -> Shape:
        return Shape(1, 1, 1, source="suffix") if len(suffix_boost) > 3 else Shape(0)

    def observe_suffix_tail(self, match: int, cached: bool, first: int, drafted_depth: int, accepted: int) -> None:
        self.tails.append((first, drafted_depth, accepted))


def test_the_rest_of_a_chain_accepted_whole_is_checked_against_the_next_tokens(bare, plain):
    """A greedy round that verifies 1 token of a longer chain and keeps it, with the bonus token on the chain too,
    hands the chain's rest, from depth 3, to be checked against the tokens the target emits next."""
    policy = ShortChains()
    for p in PROMPTS:
        prompt = bare.target.tokenize(bare.render([{"role": "user", "content": p}]), add_special=False)
        bare.target.reset()
        steps = list(generate_tokens(bare.target, None, prompt, max_new_tokens=N_NEW, draft_len=1, policy=policy,
                                     suffix=SuffixCache()))
        assert [t for s in steps for t in s.tokens] == plain[p], f"diverged on {p[:50]!r}"
    assert policy.tails, "no chain was accepted whole with a rest to check"
    assert all(first == 3 and 0 <= right <= checked <= 8 - 2 for first, checked, right in policy.tails)
    assert any(right > 0 for _, _, right in policy.tails)  # a copy's rest was right beyond what was verified


@pytest.fixture()
def cheap_rows(bare):
    """Copying pays whatever this machine's t(n) (``tests/curves.py``); the machine's curve is put back after."""
    from tests.curves import cheap_rows_in

    with cheap_rows_in(bare):
        yield


def test_auto_without_a_draft_model_uses_the_suffix_structure_and_stays_lossless(bare, plain, cheap_rows):
    bare.suffix_cache.clear()
    suffix_rounds, accepted = 0, {}
    for p in PROMPTS:
        out = bare.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW)  # auto: no draft, suffix on
        assert out.tokens == plain[p], f"diverged on {p[:50]!r}"
        suffix_rounds += sum(r.source == "suffix" and r.drafted > 0 for r in out.stats.rounds)
        accepted[p] = sum(r.accepted for r in out.stats.rounds if r.source == "suffix")
    assert len(bare.suffix_cache) == len(PROMPTS)
    # the same request again: the cache holds its answer, and auto drafts more of it than the first time
    again = bare.chat([{"role": "user", "content": GROUNDED[0]}], max_new_tokens=N_NEW)
    assert again.tokens == plain[GROUNDED[0]]
    assert suffix_rounds > 0
    assert sum(r.accepted for r in again.stats.rounds if r.source == "suffix") > accepted[GROUNDED[0]]
    assert len(bare.suffix_cache) == len(PROMPTS)  # a repeated prompt replaces its entry


def test_no_lookup_turns_copying_off_and_leaves_the_cache_alone(bare, plain, cheap_rows):
    """``lookup=False`` (``--no-lookup``) with the suffix default: no copies and nothing cached, where the
    default copies the same answer."""
    bare.suffix_cache.clear()
    off = bare.chat([{"role": "user", "content": REPEAT}], max_new_tokens=N_NEW, lookup=False)
    assert off.tokens == plain[REPEAT] and not any(r.drafted for r in off.stats.rounds)
    assert len(bare.suffix_cache) == 0
    on = bare.chat([{"role": "user", "content": REPEAT}], max_new_tokens=N_NEW)
    assert on.tokens == plain[REPEAT] and any(r.source == "suffix" and r.drafted for r in on.stats.rounds)
    assert len(bare.suffix_cache) == 1
    bare.suffix_cache.clear()


def test_auto_beside_a_draft_model_copies_from_the_suffix_structure_by_default_and_stays_lossless(hs):
    """The default of ``generate``/``chat`` (and of ``run``) with a draft model: the suffix structure in prompt
    lookup's place, fed by the object's own cache; ``suffix=False`` goes back to prompt lookup."""
    from tests.curves import cheap_rows_in

    hs.suffix_cache.clear()
    sources: dict[bool | None, set[str]] = {None: set(), False: set()}
    with cheap_rows_in(hs):  # copying pays whatever this machine's curve
        for p in PROMPTS[:3]:
            hs.reset()
            plain = hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, draft_len=0).tokens
            for suffix in sources:
                out = hs.chat([{"role": "user", "content": p}], max_new_tokens=N_NEW, suffix=suffix)
                assert out.tokens == plain, f"diverged on {p[:50]!r} with suffix={suffix}"
                sources[suffix] |= {r.source for r in out.stats.rounds if r.drafted}
    assert "suffix" in sources[None] and "lookup" not in sources[None]  # the suffix structure replaces lookup
    assert "lookup" in sources[False] and "suffix" not in sources[False]
    assert len(hs.suffix_cache) == 3  # the default runs fed the object's cache; suffix=False runs did not
    hs.suffix_cache.clear()


def test_run_without_a_draft_copies_and_keeps_its_cache_in_a_file(model_path, tmp_path):
    """``run MODEL`` with no draft file: auto with the suffix structure, the --no-draft output, and
    --suffix-cache carries the outputs to the next run, which drafts the same answer from it."""
    from tests.integration.test_cli import hetero

    from hetero_spec.target.llama_target import default_threads
    from tests.curves import cheap_rows_cached

    args = ("run", model_path, "-p", bench_prompts("mt_bench", 1)[0], "-n", "40", "--ctx", "1024")
    plain = hetero(*args, "--no-draft")
    cache = tmp_path / "suffix.json"
    with cheap_rows_cached(model_path, default_threads()):  # copying pays whatever this machine's t(n)
        runs = [hetero(*args, "--suffix-cache", cache, "--stats-json", tmp_path / f"{i}.json") for i in range(2)]
    for proc in [plain, *runs]:
        assert proc.returncode == 0, proc.stderr
    assert runs[0].stdout == runs[1].stdout == plain.stdout
    saved = SuffixCache()
    assert saved.load(cache) == 1  # the same prompt again replaced its entry
    import json

    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert second["suffix_rounds"] > 0 and second["rounds"] < first["rounds"]  # its answer, drafted from the file
