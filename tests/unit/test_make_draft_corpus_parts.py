"""How ``make-draft`` cuts its corpus budget into parts: the source's share first, then the model's own requests
(``--self-prompts``, and the time a source that runs out leaves).

Pure planning (``pipeline._next_part``): which kind of part comes next, how large, and when the corpus is
complete, from the parts already recorded and the seconds they took.  The parts themselves (llama.cpp
decodes) run in ``tests/integration/test_make_draft.py``.
"""
from __future__ import annotations

from hetero_spec.make_draft.pipeline import MIN_PART_S, N_SEQ, _next_part
from hetero_spec.make_draft.plan import Budget, Plan

CORPUS_S = 1000.0


def plan(self_prompts: float = 0.4, max_conversations: int = 0) -> Plan:
    return Plan(model="m.gguf", model_size=1, fingerprint={}, n_layer=30, hours=1.0, device="cpu", gpu=False,
                budget=Budget(corpus_s=CORPUS_S, train_s=2000.0, check_s=100.0, reserve_s=100.0), taps=(),
                source="sharegpt", max_new_tokens=256, max_conversations=max_conversations, threads=2,
                self_prompts=self_prompts)


def source_part(i: int, offset: int, limit: int, seconds: float) -> dict:
    return dict(dir=f"part-{i:03d}", offset=offset, limit=limit, done=True, seconds=seconds, conversations=limit)


def self_part(i: int, seed: int, limit: int, seconds: float, kept: int) -> dict:
    return dict(dir=f"part-{i:03d}", kind="self", seed=seed, limit=limit, done=True, seconds=seconds,
                conversations=kept)


def test_the_source_comes_first_a_probe_then_parts_sized_to_a_quarter_of_its_share():
    first = _next_part(plan(), [], n_source=10_000)
    assert first == dict(dir="part-000", offset=0, limit=2 * N_SEQ, done=False, seconds=0.0)
    # 32 conversations in 20 s: 1.6 a second, over a quarter of the source's 600 s
    second = _next_part(plan(), [source_part(0, 0, 32, 20.0)], n_source=10_000)
    assert second["offset"] == 32 and second["limit"] == int(1.6 * 150) and "kind" not in second


def test_when_the_sources_share_is_spent_the_model_writes_requests_for_the_rest():
    parts = [source_part(0, 0, 32, 20.0), source_part(1, 32, 900, 590.0)]  # 610 s: past 60% of 1000
    probe = _next_part(plan(), parts, n_source=10_000)
    assert probe == dict(dir="part-002", kind="self", seed=0, limit=2 * N_SEQ, done=False, seconds=0.0)
    # the probe kept 24 answered requests in 30 s: 0.8 a second, over a quarter of the 390 s the source left, within
    # the 360 s left of the whole budget
    parts.append(self_part(2, 0, 32, 30.0, kept=24))
    nxt = _next_part(plan(), parts, n_source=10_000)
    assert nxt["kind"] == "self" and nxt["seed"] == 1 and nxt["dir"] == "part-003"
    assert nxt["limit"] == int(0.8 * max(MIN_PART_S, 390.0 / 4))
    # the budget spent: the corpus is complete
    parts.append(self_part(3, 1, nxt["limit"], 360.0, kept=70))
    assert _next_part(plan(), parts, n_source=10_000) is None


def test_the_probe_of_the_models_requests_runs_even_after_the_source_overran_the_budget():
    parts = [source_part(0, 0, 32, 20.0), source_part(1, 32, 2000, 1100.0)]
    assert _next_part(plan(), parts, n_source=10_000)["kind"] == "self"
    parts.append(self_part(2, 0, 32, 30.0, kept=24))
    assert _next_part(plan(), parts, n_source=10_000) is None


def test_a_model_that_writes_no_request_it_ends_stops_the_kind():
    parts = [source_part(0, 0, 32, 20.0), source_part(1, 32, 900, 590.0), self_part(2, 0, 32, 40.0, kept=0)]
    assert _next_part(plan(), parts, n_source=10_000) is None


def test_a_short_source_leaves_its_time_to_the_models_requests_even_without_a_share():
    for share in (0.4, 0.0):  # the default gives them no share of their own
        parts = [source_part(0, 0, 32, 20.0), source_part(1, 32, 8, 5.0)]  # a 40-conversation file, taken whole
        assert _next_part(plan(share), parts, n_source=40)["kind"] == "self"
        parts.append(self_part(2, 0, 32, 25.0, kept=32))
        # 950 s of the whole budget left; a part covers at most a quarter of the 975 s the source left, at 1.28 a second
        assert _next_part(plan(share), parts, n_source=40)["limit"] == int(32 / 25.0 * 975.0 / 4)
    # --max-conversations caps the source alone, and leaves its time to them only where they have a share
    capped = [source_part(0, 0, 32, 20.0)]
    assert _next_part(plan(max_conversations=32), capped, n_source=10_000)["kind"] == "self"
    assert _next_part(plan(0.0, max_conversations=32), capped, n_source=10_000) is None


def test_by_default_the_source_takes_the_whole_budget():
    parts = [source_part(0, 0, 32, 20.0), source_part(1, 32, 900, 590.0)]
    nxt = _next_part(plan(self_prompts=0.0), parts, n_source=10_000)  # the default, and plans made before the option
    assert "kind" not in nxt and nxt["offset"] == 932
    assert nxt["limit"] == int(932 / 610.0 * 250.0)  # the rate so far, over a quarter of the whole 1000 s
    done = parts + [source_part(2, 932, 600, 400.0)]
    assert _next_part(plan(self_prompts=0.0), done, n_source=10_000) is None
    # all of it on the model's own requests: no source part at all
    assert _next_part(plan(self_prompts=1.0), [], n_source=10_000)["kind"] == "self"


def test_a_plan_made_before_loops_were_stopped_keeps_its_corpus_parts_as_they_were_made():
    """A work folder's plan.json from before ``stop_loops``: its parts ran every turn to its end, and a resumed part
    must ask for the same (generate_corpus refuses a folder made with other options)."""
    import json
    from dataclasses import asdict

    old = asdict(plan())
    del old["stop_loops"]
    assert Plan.from_dict(json.loads(json.dumps(old))).stop_loops == 0
