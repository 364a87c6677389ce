"""Projected speedups: a run's recorded rounds priced by another machine's cost curve.

Greedy speculation is lossless, so the token sequence, and with it which drafts the target
accepts, is the target's alone and does not depend on the machine.  What a round costs does:
verifying n rows costs t(n)/t(1) single-row decodes (steep on 2 small cores, nearly flat on a
memory-bound 7B laptop).  Replaying each prompt's ``Round`` records against a curve gives

    projected decode speedup = sum(emitted tokens) / sum(t(rows)/t(1) + (draft steps x step + switch)/t(1))

against plain decoding, which pays t(1) per token.  A round verifies drafted + 1 rows; a
draft-model chain costs one draft step per drafted token, a shadow probe (no rows drafted)
one step per token it drafted, a copied round (prompt lookup, suffix trees) none; a round that ran the draft also pays
the curve's ``draft_switch_ms`` once (its first forward right after a target decode).  A tree
round drafts a whole level per forward, as auto's cost model prices it: one step for its first
depth, then one forward over each later depth's forwarded nodes (``draft_rows_ms``, taken at the
round's mean rows per forward; where a curve has no row forwards, one step per node), from the
forwards and rows the round recorded (``levels``, ``draft_rows``; a bench.json from before
``draft_rows`` takes the tree's mean nodes per depth, one from before ``levels`` a step per node).  Prefill and the
orchestrator's own per-round overhead are left out: these are projections of decode speed,
labelled as such wherever they are printed.

A curve timed in the same run (``this-run``) is priced at each prompt's own decode speed: its
target times are scaled so that t(1) is the baseline's measured time per token on that prompt,
its draft times kept.  The target's decode cost follows the context (attention over every cached
cell; on SmolLM2 Q4_0 raw decoding ran 5.9 ms a token on alpaca's short prompts and 8.1 on
HumanEval's long ones), a draft step's barely (its context is cut at a few hundred positions and
its weights dominate), so with one t(1) for every prompt the draft looked cheap on short prompts:
chain k=1 was projected 19% above its measured speed on alpaca, 7% with each prompt's own t(1).

>>> curve = CostCurve({1: 10.0, 2: 10.0}, draft_step_ms=0.0)
>>> replay([[1, 1, 2, 0, 0, 0, "draft"], [1, 0, 1, 0, 0, 0, "draft"]], curve).speedup   # 3 tokens, 2 rounds
1.5
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from ..calibration import CostCurve
from ..errors import HeteroSpecError
from ..spec.policy import CATCHUP_ROWS
from .results import ROUND_FIELDS, BenchResult, PromptRecord

# Curves shipped in hetero_spec/bench/data/curves/ (see data/README.md).
CURVES = {
    "this-machine": "this-machine.json",  # hetero-spec calibrate on the development VM
    "laptop-7b-q4_0": "laptop-7b-q4_0.json",  # roofline.LAPTOP_7B_Q4_0
}
# Not a file: the bench times a calibration pass after every prompt and projects with their medians
# (``BenchConfig.calibrate``), so that the curve sees the machine in the same minutes as the prompts.
THIS_RUN = "this-run"
_I = {name: i for i, name in enumerate(ROUND_FIELDS)}


def load_curve(spec: str) -> tuple[str, CostCurve]:
    """A shipped curve by name, or a CostCurve JSON file (``hetero-spec calibrate --out``); (label, curve)."""
    if spec in CURVES and not Path(spec).exists():
        res = resources.files(__package__).joinpath("data", "curves", CURVES[spec])
        if not res.is_file():
            raise HeteroSpecError(f"shipped cost curve {CURVES[spec]} is missing from the hetero_spec package; reinstall")
        return spec, CostCurve.from_json(res.read_text())
    path = Path(spec)
    if not path.is_file():
        raise HeteroSpecError(f"no cost curve {spec!r}: use {', '.join(CURVES)}, {THIS_RUN} or a calibration JSON file")
    return path.stem, CostCurve.from_json(path.read_text())


def this_run_curve(result: BenchResult) -> CostCurve:
    """The curve a bench run with ``calibrate`` measured alongside its prompts."""
    cal = result.meta.get("calibration")
    if not cal:
        raise HeteroSpecError("this bench run timed no calibration passes")
    return CostCurve.from_json(json.dumps(cal["curve"]))


@dataclass(frozen=True)
class Replay:
    tokens: int  # tokens the rounds emitted
    rounds: int
    cost: float  # in single-row decodes, t(1) = 1

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost > 0 else 0.0


def _field(row: Sequence[Any], name: str, default: Any) -> Any:
    """A round's field, or ``default`` in a bench.json written before the field existed."""
    return row[_I[name]] if len(row) > _I[name] else default


def _draft_steps(row: Sequence[Any]) -> int:
    """Draft-model steps a recorded round ran: one per drafted token, a shadow probe's depth, none for a copy."""
    if row[_I["source"]] in ("lookup", "suffix"):
        return 0
    if row[_I["drafted"]] > 0:
        return row[_I["drafted"]]
    if len(row) > _I["shadow"]:
        return row[_I["shadow"]]  # a shadow probe: the draft ran that many steps, no row was added
    return 1 if row[_I["draft_s"]] > 0 else 0  # bench.json from before "shadow": its shadow probes drafted one


def round_cost(row: Sequence[Any], curve: CostCurve, catchup: int = 1) -> float:
    """One recorded round (a ``ROUND_FIELDS`` row) in single-row decodes on ``curve``; ``catchup``: the
    real rows the draft's first forward consumes (``replay`` counts them), priced where the curve
    measured draft forwards over n rows."""
    drafted = row[_I["drafted"]]
    if drafted < 0:
        raise HeteroSpecError(f"a round cannot draft {drafted} tokens")
    steps = _draft_steps(row)
    draft_ms = 0.0
    levels, rows = _field(row, "levels", 0), _field(row, "draft_rows", 0)
    if steps:
        if rows and levels > 1:  # a tree: its first depth one step, then forwards over the rows they recorded
            draft_ms = curve.draft_step_ms + (levels - 1) * curve.draft_rows_time_ms(-(-rows // (levels - 1)))
        elif 0 < levels < drafted:  # a tree before "draft_rows": each later depth one forward over its nodes
            draft_ms = curve.draft_step_ms + (levels - 1) * curve.draft_rows_time_ms(-(-drafted // levels))
        else:
            draft_ms = steps * curve.draft_step_ms
        draft_ms += curve.draft_switch_ms
        if catchup > 1 and curve.draft_rows_ms:
            draft_ms += curve.draft_rows_time_ms(catchup) - curve.draft_rows_time_ms(1)
    return curve.verify_ratio(drafted + 1) + draft_ms / curve.verify_ms[1]


def replay(rounds: Sequence[Sequence[Any]], curve: CostCurve) -> Replay:
    """The rounds of one generation priced on ``curve``.  A round that runs the draft first consumes
    the rows emitted since the draft last ran (at most ``CATCHUP_ROWS``; the prompt's rows are
    prefilled apart): after a k=1 round the draft reads one or two rows, not the one a step times."""
    cost, since = 0.0, 1
    for r in rounds:
        cost += round_cost(r, curve, min(since, CATCHUP_ROWS))
        since = int(r[_I["emitted"]]) + (0 if _draft_steps(r) else since)
    return Replay(sum(int(r[_I["emitted"]]) for r in rounds), len(rounds), cost)


def at_decode_speed(curve: CostCurve, t1_ms: float) -> CostCurve:
    """``curve`` with its target times scaled so that t(1) = ``t1_ms``, its draft times unchanged."""
    f = t1_ms / curve.verify_ms[1]
    return replace(curve, verify_ms={n: v * f for n, v in curve.verify_ms.items()})


def decode_tps(rec: PromptRecord) -> float | None:
    """Measured decode speed: tokens after the first over the time after the first (None if unknown)."""
    if rec.prefill_s is None or rec.new_tokens < 2 or rec.wall_s <= rec.prefill_s:
        return None
    return (rec.new_tokens - 1) / (rec.wall_s - rec.prefill_s)


def project_result(result: BenchResult, curves: dict[str, CostCurve], baseline: str = "raw",
                   local: tuple[str, ...] = (THIS_RUN,)) -> list[dict[str, Any]]:
    """Per curve, method (those with recorded rounds) and dataset (plus ``all``): the median over
    prompts of the projected speedup, beside the median measured decode speedup over ``baseline``.
    Curves named in ``local`` were timed on this run's machine: each prompt is priced at the
    baseline's own decode speed on it (``at_decode_speed``)."""
    base = {(r.dataset, r.index): r for r in result.records if r.method == baseline}
    methods = list(dict.fromkeys(r.method for r in result.records if r.rounds and r.method != baseline))
    datasets = list(dict.fromkeys(r.dataset for r in result.records))
    rows = []
    for label, curve in curves.items():
        for m in methods:
            for d in datasets + ["all"]:
                recs = [r for r in result.records if r.method == m and r.rounds and d in ("all", r.dataset)]
                if recs:
                    rows.append(_row(label, curve, m, d, recs, base, label in local))
    return rows


def _row(label: str, curve: CostCurve, method: str, dataset: str, recs: list[PromptRecord],
         base: dict[tuple[str, int], PromptRecord], local: bool) -> dict[str, Any]:
    replays, measured = [], []
    for r in recs:
        b = base.get((r.dataset, r.index))
        mine, theirs = decode_tps(r), decode_tps(b) if b else None
        if mine and theirs:
            measured.append(mine / theirs)
        replays.append(replay(r.rounds, at_decode_speed(curve, 1e3 / theirs) if local and theirs else curve))
    return {
        "curve": label, "method": method, "dataset": dataset, "prompts": len(recs),
        "projected_speedup": statistics.median(p.speedup for p in replays),
        "measured_decode_speedup": statistics.median(measured) if measured else None,
        "tokens_per_round": sum(p.tokens for p in replays) / max(1, sum(p.rounds for p in replays)),
        "curve_t1_ms": curve.verify_ms[1], "t1": "per prompt, the baseline's decode" if local else "the curve's",
        "curve_machine": curve.machine, "curve_model": curve.model,
        "label": "PROJECTION (decode only, rounds replayed on the curve), not a measurement",
    }


__all__ = ["CURVES", "THIS_RUN", "this_run_curve", "load_curve", "replay", "at_decode_speed", "round_cost", "project_result", "Replay", "decode_tps"]
