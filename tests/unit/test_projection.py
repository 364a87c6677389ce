"""Projected speedups: the replay arithmetic on hand-built rounds, the shipped curves, bench.json round trip."""
from __future__ import annotations

import json

import pytest

from hetero_spec.bench.projection import CURVES, load_curve, project_result, replay, round_cost
from hetero_spec.bench.report import bench_dict, projection_markdown
from hetero_spec.bench.results import ROUND_FIELDS, BenchResult, PromptRecord, load_bench_json, round_row
from hetero_spec.bench.roofline import LAPTOP_7B_Q4_0, Roofline
from hetero_spec.calibration import CostCurve
from hetero_spec.errors import HeteroSpecError
from hetero_spec.records import Round


def rnd(drafted: int, accepted: int, *, emitted: int | None = None, draft_s: float = 0.0, source: str = "draft",
        shadow: int = 0, levels: int | None = None, draft_rows: int = 0):
    """A ROUND_FIELDS row as the bench stores it (through round_row, so the layout is the real one); a model
    round's ``levels`` default to a chain's, one per drafted token."""
    if levels is None:
        levels = drafted if source == "draft" else 0
    r = Round(drafted=drafted, accepted=accepted, emitted=accepted + 1 if emitted is None else emitted,
              draft_s=draft_s, verify_s=0.01, overhead_s=0.001, bytes_to_target=4 * (drafted + 1), bytes_to_draft=0,
              source=source, shadow=shadow, levels=levels, draft_rows=draft_rows)
    return round_row(r)


FLAT = CostCurve({n: 10.0 for n in range(1, 9)}, draft_step_ms=0.0)  # t(n) = t(1), free drafts
LINEAR = CostCurve({n: 10.0 * n for n in range(1, 9)}, draft_step_ms=0.0)  # t(n) = n t(1)


def test_flat_curve_without_draft_cost_projects_tokens_per_round():
    rounds = [rnd(3, 3), rnd(3, 0), rnd(3, 1), rnd(0, 0)]  # 4 + 1 + 2 + 1 = 8 tokens in 4 rounds
    p = replay(rounds, FLAT)
    assert (p.tokens, p.rounds) == (8, 4)
    assert p.speedup == pytest.approx(8 / 4)


def test_linear_curve_makes_full_acceptance_break_even():
    """Verifying k+1 rows costs k+1 decodes: accepting all k drafts only breaks even, rejecting loses."""
    assert replay([rnd(3, 3)] * 5, LINEAR).speedup == pytest.approx(1.0)
    assert replay([rnd(3, 0)] * 5, LINEAR).speedup == pytest.approx(1 / 4)


def test_draft_steps_are_priced_per_drafted_token_and_lookup_is_free():
    curve = CostCurve({1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}, draft_step_ms=5.0)  # a step costs half a decode
    assert round_cost(rnd(2, 2), curve) == pytest.approx(1 + 2 * 0.5)
    assert round_cost(rnd(2, 2, source="lookup"), curve) == pytest.approx(1.0)
    assert round_cost(rnd(0, 0, draft_s=0.002, shadow=3), curve) == pytest.approx(2.5)  # a shadow probe: 3 steps, 1 row
    assert round_cost(rnd(0, 0, draft_s=0.002)[:-3], curve) == pytest.approx(1.5)  # a bench.json before "shadow"
    assert round_cost(rnd(2, 2, source="suffix"), curve) == pytest.approx(1.0)  # copied from the suffix trees
    assert round_cost(rnd(0, 0), curve) == pytest.approx(1.0)  # a plain round
    assert replay([rnd(2, 2), rnd(2, 2, source="lookup")], curve).speedup == pytest.approx(6 / 3.0)


def test_a_round_that_ran_the_draft_pays_the_switch_once():
    """The first draft forward after a target decode runs with the draft's weights evicted: priced once
    per round that ran the draft (chains and shadow probes alike), never for lookup or plain rounds."""
    curve = CostCurve({1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}, draft_step_ms=5.0, draft_switch_ms=2.0)
    assert round_cost(rnd(3, 3), curve) == pytest.approx(1 + 3 * 0.5 + 0.2)
    assert round_cost(rnd(0, 0, draft_s=0.002, shadow=2), curve) == pytest.approx(1 + 2 * 0.5 + 0.2)
    assert round_cost(rnd(3, 3, source="lookup"), curve) == pytest.approx(1.0)
    assert round_cost(rnd(0, 0), curve) == pytest.approx(1.0)


def test_the_draft_catches_up_on_the_rows_emitted_since_it_last_ran():
    """A round that runs the draft first reads every row emitted since the draft last ran (the previous
    chain's accepted tokens plus the target's own, or a lookup round's), priced by the curve's row forwards."""
    curve = CostCurve({n: 10.0 for n in range(1, 9)}, draft_step_ms=1.0, draft_rows_ms={1: 1.0, 2: 3.0, 4: 5.0})
    rounds = [rnd(1, 1), rnd(1, 0), rnd(2, 2, source="lookup"), rnd(1, 1)]  # emit 2, 1, 3, 2
    p = replay(rounds, curve)
    # rows read 1, 2, -, 1 + 3 (the lookup round's three wait for the draft): + 0, 2, -, 4 ms on one step's 1 ms
    assert p.cost == pytest.approx((1 + 0.1) + (1 + 0.1 + 0.2) + 1 + (1 + 0.1 + 0.4))
    no_rows = CostCurve({n: 10.0 for n in range(1, 9)}, draft_step_ms=1.0)  # not measured: not priced
    assert replay(rounds, no_rows).cost == pytest.approx(4 + 0.3)


def test_a_tree_is_priced_per_depth_not_per_node():
    """A tree drafts a whole depth per forward: its first depth one step, each later depth one forward over
    its nodes (the curve's row forwards at the tree's mean nodes per depth), as auto's cost model prices it.
    The forwards are the ones the round recorded: a greedy tree forwards only the nodes that could grow, and
    keeps its best nodes of all depths, so its final shape does not say what it ran.  A bench.json from before
    ``draft_rows`` takes the tree's mean nodes per depth, one from before ``levels`` a step per node, and so
    does a curve without row forwards."""
    curve = CostCurve({n: 10.0 for n in range(1, 9)}, draft_step_ms=2.0, draft_rows_ms={1: 2.0, 2: 3.0, 3: 4.0},
                      draft_switch_ms=1.0)
    tree = rnd(6, 2, levels=3, draft_rows=4)  # a step, then two forwards over 2 rows each
    assert round_cost(tree, curve) == pytest.approx(1 + (2.0 + 2 * 3.0 + 1.0) / 10)
    # two siblings kept after a forward over the first: priced as run, not as a one-depth tree
    assert round_cost(rnd(2, 1, levels=2, draft_rows=1), curve) == pytest.approx(1 + (2.0 + 2.0 + 1.0) / 10)
    assert round_cost(rnd(6, 2, levels=2, draft_rows=3), curve) == pytest.approx(1 + (2.0 + 4.0 + 1.0) / 10)
    assert round_cost(rnd(3, 3), curve) == pytest.approx(1 + (3 * 2.0 + 1.0) / 10)  # a chain: a step a token
    assert round_cost(rnd(5, 2, levels=2)[:-1], curve) == pytest.approx(1 + (2.0 + 4.0 + 1.0) / 10)  # 3 nodes a depth
    assert round_cost(tree[:-2], curve) == pytest.approx(1 + (6 * 2.0 + 1.0) / 10)  # before "levels": per node
    no_rows = CostCurve({n: 10.0 for n in range(1, 9)}, draft_step_ms=2.0)
    assert round_cost(tree, no_rows) == pytest.approx(1 + (2.0 + 2 * 2 * 2.0) / 10)


def test_interpolated_curve_and_truncated_rounds():
    curve = CostCurve({1: 10.0, 3: 20.0}, draft_step_ms=0.0)  # t(2) interpolates to 15 ms
    assert round_cost(rnd(1, 1), curve) == pytest.approx(1.5)
    # a stop string cut the round short: the tokens emitted count, not accepted + 1
    assert replay([rnd(2, 2, emitted=1)], curve).speedup == pytest.approx(1 / 2.0)


def test_round_row_layout_matches_fields():
    row = rnd(2, 1, draft_s=0.5, source="lookup")
    assert dict(zip(ROUND_FIELDS, row)) == {"drafted": 2, "accepted": 1, "emitted": 2, "draft_s": 0.5,
                                            "verify_s": 0.01, "overhead_s": 0.001, "source": "lookup", "shadow": 0,
                                            "levels": 0, "draft_rows": 0}


def _record(method: str, index: int, rounds: list, wall_s: float, prefill_s: float, new_tokens: int) -> PromptRecord:
    return PromptRecord(method=method, dataset="gsm8k", index=index, prompt_tokens=30, new_tokens=new_tokens,
                        wall_s=wall_s, tokens_per_s=new_tokens / wall_s, speedup=1.0, equal=True, prefill_s=prefill_s,
                        rounds=rounds)


@pytest.fixture()
def result() -> BenchResult:
    # raw decodes 8 tokens after the first in 0.8 s; chain does it in 0.4 s (measured decode speedup 2.0)
    recs = [_record("raw", 0, [], 1.0, 0.2, 9), _record("chain", 0, [rnd(3, 3), rnd(3, 3)], 0.7, 0.3, 9),
            _record("raw", 1, [], 1.0, 0.2, 9), _record("chain", 1, [rnd(3, 1)] * 4, 1.1, 0.3, 9)]
    return BenchResult({"methods": {"raw": "", "chain": ""}}, recs)


def test_project_result_puts_projection_beside_measurement(result):
    rows = {(r["curve"], r["dataset"]): r for r in project_result(result, {"flat": FLAT, "linear": LINEAR})}
    assert set(rows) == {("flat", "gsm8k"), ("flat", "all"), ("linear", "gsm8k"), ("linear", "all")}
    flat = rows[("flat", "all")]
    assert flat["method"] == "chain" and flat["prompts"] == 2
    assert flat["projected_speedup"] == pytest.approx((4.0 + 2.0) / 2)  # median of 8/2 and 8/4
    assert flat["tokens_per_round"] == pytest.approx(16 / 6)
    assert flat["measured_decode_speedup"] == pytest.approx((2.0 + 1.0) / 2)  # 0.8/0.4 and 0.8/0.8
    assert rows[("linear", "all")]["projected_speedup"] == pytest.approx((1.0 + 0.5) / 2)
    assert "PROJECTION" in flat["label"]


def test_a_curve_from_this_run_prices_each_prompt_at_the_baselines_decode_speed():
    """Target times follow the prompt's own decode speed (its context), the draft's stay as timed."""
    curve = CostCurve({1: 10.0, 2: 15.0}, draft_step_ms=5.0)
    recs = [_record("raw", 0, [], 0.9, 0.1, 9),  # 8 tokens in 0.8 s: 100 ms a token, ten times the curve's t(1)
            _record("chain", 0, [rnd(1, 1)] * 4, 0.9, 0.1, 9),
            _record("raw", 1, [], 0.18, 0.1, 9),  # 10 ms a token, the curve's own t(1)
            _record("chain", 1, [rnd(1, 1)] * 4, 0.9, 0.1, 9)]
    res = BenchResult({"methods": {"raw": "", "chain": ""}}, recs)
    mine = {r["dataset"]: r for r in project_result(res, {"mine": curve}, local=("mine",))}
    other = {r["dataset"]: r for r in project_result(res, {"mine": curve}, local=())}
    slow, usual = 8 / (4 * (1.5 + 5 / 100)), 8 / (4 * (1.5 + 5 / 10))  # a k=1 round: 1.5 t(1) and a step
    assert mine["all"]["projected_speedup"] == pytest.approx((slow + usual) / 2)
    assert other["all"]["projected_speedup"] == pytest.approx(usual)
    assert mine["all"]["t1"].startswith("per prompt") and other["all"]["t1"] == "the curve's"


def test_projections_survive_bench_json_and_are_labelled(result, tmp_path):
    result.projections = project_result(result, {"flat": FLAT})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_dict(result)))
    back = load_bench_json(path)
    assert back.records == result.records and back.projections == result.projections
    assert project_result(back, {"flat": FLAT}) == result.projections  # a replay of the file gives the same
    md = "\n".join(projection_markdown(result.projections))
    assert "PROJECTIONS, not measurements" in md and "| flat | chain | all | 3.00x | 1.50x | 2.67 |" in md


def test_load_bench_json_rejects_other_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(HeteroSpecError, match="not a bench.json"):
        load_bench_json(bad)
    with pytest.raises(HeteroSpecError, match="no bench.json"):
        load_bench_json(tmp_path / "missing.json")


# ------------------------------------------------------------------ the shipped curves
def test_shipped_curves_load_by_name():
    for name in CURVES:
        label, curve = load_curve(name)
        assert label == name and curve.verify_ms[1] > 0 and curve.draft_step_ms > 0
        ratios = [curve.verify_ratio(n) for n in range(1, 33)]
        assert ratios[0] == 1.0 and max(ratios) > 1.0 and curve.machine and curve.model
    with pytest.raises(HeteroSpecError, match="no cost curve 'nope'"):
        load_curve("nope")


def test_laptop_curve_is_the_documented_roofline():
    """The shipped JSON is what roofline.py computes from its cited figures (regenerate it when they change)."""
    _, shipped = load_curve("laptop-7b-q4_0")
    made = LAPTOP_7B_Q4_0.curve()
    assert shipped.verify_ms == made.verify_ms and shipped.draft_step_ms == made.draft_step_ms
    assert shipped.draft_rows_ms == made.draft_rows_ms
    # memory-bound at 1 row: 3.8 GB at 64 GB/s; flat until n rows of compute exceed that
    assert shipped.verify_ms[1] == pytest.approx(1e3 * 3.8e9 / 64e9, rel=1e-4)
    assert shipped.verify_ratio(3) == 1.0 and 1.0 < shipped.verify_ratio(4) < 1.5


def test_roofline_arithmetic():
    r = Roofline("toy", weight_bytes=1e9, params=1e9, bandwidth=1e10, compute=1e11, draft_bytes=1e8, draft_params=1e6)
    assert r.verify_ms(1) == pytest.approx(100.0)  # 1 GB at 10 GB/s
    assert r.verify_ms(5) == pytest.approx(100.0)  # 5 rows x 2 GFLOP at 100 GFLOP/s: exactly the memory time
    assert r.verify_ms(10) == pytest.approx(200.0)  # compute-bound beyond
    assert r.draft_step_ms() == pytest.approx(10.0)
    assert r.draft_rows_ms(500) == pytest.approx(10.0)  # 500 rows x 2 MFLOP at 100 GFLOP/s: the memory time
    assert r.draft_rows_ms(1000) == pytest.approx(20.0)
    # while flat, a chain that accepts all 3 drafts projects 4 tokens per (1 decode + 3 draft steps of 0.1)
    assert replay([rnd(3, 3)] * 3, r.curve(8)).speedup == pytest.approx(4 / 1.3)
