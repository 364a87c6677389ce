"""How ``make-draft`` splits the hour and cuts its corpus budget into parts: the source's share first, then the
model's own requests (``--self-prompts``, and the time a source that runs out leaves).

Pure planning (``plan.split_budget``, ``pipeline._next_part``): which kind of part comes next, how large, and when
the corpus is complete, from the parts already recorded and the seconds they took; and what the report counts of
the parts (``pipeline.looped_turns``).  The parts themselves (llama.cpp decodes) run in
``tests/integration/test_make_draft.py``.
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


def test_the_hour_is_split_whole_the_check_capped_and_a_gpu_giving_the_corpus_more():
    """``split_budget``: every second of ``--hours`` goes to a stage, the held-out check never takes more than
    10 minutes, and a GPU (whose training steps are cheap) leaves the corpus more than a CPU does.  A plan keeps the
    split it was made with (plan.json), so a change of shares reaches new work folders only."""
    import json
    from dataclasses import asdict

    from hetero_spec.make_draft.plan import split_budget

    for hours in (0.02, 1.0, 8.0):
        cpu, gpu = split_budget(hours, gpu=False), split_budget(hours, gpu=True)
        for b in (cpu, gpu):
            assert abs(b.total_s - hours * 3600) < 1e-6 and 0 < b.check_s <= 600 and b.corpus_s > 0 and b.train_s > 0
        assert gpu.corpus_s > cpu.corpus_s and gpu.train_s < cpu.train_s
    old = asdict(plan())
    assert Plan.from_dict(json.loads(json.dumps(old))).budget == plan().budget


def test_the_report_counts_the_turns_each_part_ended_in_a_loop(tmp_path):
    """``looped_turns`` sums the parts' manifests (the corpus's own count, also for parts recorded before the report
    had one); a part with nothing to answer has no folder and counts none; the summary line says it when any did."""
    import json

    from hetero_spec.make_draft.pipeline import Paths, looped_turns
    from hetero_spec.make_draft.report import summary_lines

    paths = Paths(work=tmp_path / "w", out=tmp_path / "d.safetensors")
    for name, looped in (("part-000", 7), ("part-001", 0), ("part-002", 5)):
        (paths.corpus / name).mkdir(parents=True)
        counts = {"conversations": 9, **({"stopped_in_loop": looped} if looped else {})}
        (paths.corpus / name / "manifest.json").write_text(json.dumps({"counts": counts}))
    parts = [dict(dir=f"part-{i:03d}") for i in range(4)]  # part-003: a self part that sampled nothing
    assert looped_turns(paths, parts) == 12
    report = {"draft": "d.safetensors", "training": {"steps": 3},
              "corpus": {"conversations": 27, "assistant_tokens": 900, "stopped_in_loop": 12},
              "estimated_tau_per_step": [1.5], "measured_tau_per_step": [1.4], "measured_tau_per_set": {"mt_bench": 1.4},
              "check_prompts": 4, "plot": "d.report.png"}
    assert "(900 answer tokens; 12 turns ended in a loop)" in summary_lines(report)[0]
    report["corpus"]["stopped_in_loop"] = 0
    assert "(900 answer tokens)" in summary_lines(report)[0]
