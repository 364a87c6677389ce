"""Calibration on the real GGUF and draft: a full 1..32 curve, sane JSON, the cache, the CLI."""
from __future__ import annotations

import json
from types import SimpleNamespace
import subprocess
import sys
import time

import numpy as np

import pytest

from hetero_spec import calibration
from hetero_spec.calibration import CostCurve, cache_path, load_or_measure, measure
from hetero_spec.errors import HeteroSpecError

CLI = [sys.executable, "-m", "hetero_spec"]


@pytest.fixture(scope="module")
def curve(hs):
    return measure(hs.target, hs.draft, repeats=1, model="test")


def test_curve_covers_1_to_32(curve):
    assert sorted(curve.verify_ms) == list(range(1, 33))
    assert all(v > 0 for v in curve.verify_ms.values()) and curve.verify_ratio(1) == 1.0
    assert sorted(curve.draft_rows_ms) == list(range(1, 33)) and curve.draft_step_ms > 0
    assert curve.draft_switch_ms >= 0.0
    assert "threads" in curve.machine and curve.model == "test"


def test_envelope_is_monotone_upper_bound(curve):
    env = curve.envelope_ms()
    ns = sorted(env)
    assert all(env[a] <= env[b] for a, b in zip(ns, ns[1:]))
    assert all(env[n] >= curve.verify_ms[n] for n in ns) and env[32] == max(curve.verify_ms.values())


def test_json_round_trip(curve):
    text = curve.to_json()
    data = json.loads(text)
    assert data["version"] == calibration.CURVE_VERSION and data["verify_ratio"]["1"] == 1.0
    assert CostCurve.from_json(text) == curve
    with pytest.raises(HeteroSpecError):
        CostCurve.from_json('{"verify_ms": {"2": 3.0}, "draft_step_ms": 1}')  # no t(1)
    with pytest.raises(HeteroSpecError):
        CostCurve.from_json("not json")


def test_a_curve_file_from_before_the_switch_reads_as_none():
    old = json.dumps({"verify_ms": {"1": 5.0, "2": 7.0}, "draft_step_ms": 1.5, "version": 1})
    assert CostCurve.from_json(old).draft_switch_ms == 0.0


def test_merge_takes_medians_per_row():
    a = CostCurve({1: 5.0, 2: 8.0}, 1.0, {1: 1.0}, 0.5, machine="m", model="x")
    b = CostCurve({1: 7.0, 2: 9.0, 4: 12.0}, 2.0, {1: 2.0}, 0.1, machine="m", model="x")
    c = CostCurve({1: 6.0, 2: 20.0}, 3.0, {1: 3.0}, 0.3, machine="m", model="x")
    m = calibration.merge([a, b, c])
    assert m.verify_ms == {1: 6.0, 2: 9.0, 4: 12.0}  # a row timed in one pass only keeps that timing
    assert (m.draft_step_ms, m.draft_rows_ms, m.draft_switch_ms) == (2.0, {1: 2.0}, 0.3)
    assert (m.machine, m.model) == ("m", "x")
    with pytest.raises(HeteroSpecError):
        calibration.merge([])


class _ColdAfterDecodeRunner:
    """A draft whose step is slow only right after a target decode: what the switch must isolate."""

    def __init__(self, cold_s: float) -> None:
        self.cold_s, self.cold, self.n = cold_s, False, 0

    def reset(self) -> None:
        self.n = 0

    def prefill(self, features, tokens) -> None:
        self.n += len(tokens)

    def propose(self, features, tokens, k) -> list[int]:
        if self.cold:
            time.sleep(self.cold_s)
            self.cold = False
        self.n += len(tokens) + k - 1
        return [0] * k

    def rollback(self, n_keep: int) -> None:
        self.n = n_keep


def test_switch_is_what_a_step_right_after_a_target_decode_adds():
    runner = _ColdAfterDecodeRunner(0.004)
    hidden, tokens = np.zeros((9, 4), dtype=np.float32), list(range(9))
    step, rows, switch = calibration._measure_draft(runner, hidden, tokens, [1, 2], 1, None,
                                                    after=lambda: setattr(runner, "cold", True))
    assert switch >= 0.004 * 1e3 * 0.9 and step < switch  # a warm step does nothing; a cold one sleeps 4 ms
    assert sorted(rows) == [1, 2] and runner.n == 0


def test_measure_leaves_both_caches_empty_and_embeddings_as_found(hs, curve):
    assert hs.target.n_past == 0 and hs.target.kv_pos_max() == -1 and hs.draft.n == 0
    hs.target.set_embeddings(False)
    measure(hs.target, None, ns=[1, 2], repeats=1)
    assert hs.target.embeddings is False
    # and generation afterwards still equals plain decoding
    spec = hs.chat([{"role": "user", "content": "Say hi."}], max_new_tokens=12, draft_len=3).tokens
    hs.reset()
    plain = hs.chat([{"role": "user", "content": "Say hi."}], max_new_tokens=12, draft_len=0).tokens
    assert spec == plain


def test_focus_rows_are_timed_more_often_than_the_rest(hs):
    """The first-use calibration times t(1)..t(5) nine times and the other rows three: auto's choice
    between plain rounds and short chains rests on those ratios."""
    done: list[int] = []
    c = measure(hs.target, None, ns=[1, 2, 8], repeats=1, focus=[1, 2, 5], focus_repeats=3, progress=done.append)
    assert sum(done) == 3 + 3 + 1  # rows 1 and 2 three times each, row 8 once; 5 is not a row here
    assert sorted(c.verify_ms) == [1, 2, 8]


def test_interpolation():
    c = CostCurve({1: 10.0, 4: 16.0, 8: 20.0}, 1.0)
    assert c.verify_time_ms(2) == pytest.approx(12.0) and c.verify_ratio(4) == pytest.approx(1.6)
    assert c.verify_time_ms(10) == pytest.approx(22.0)  # the last slope extended
    assert c.draft_rows_time_ms(3) == pytest.approx(3.0)  # no rows measured: n steps


def test_draft_step_warm_up_runs_for_both_its_count_and_its_time():
    """A fresh process's first draft steps run at about twice the steady cost, so the warm-up
    before the draft step is timed must not stop at a handful of calls."""
    import time

    calls = []
    t0 = time.perf_counter()
    calibration._warm_up(lambda: calls.append(1), calls=30, seconds=0.05)
    assert len(calls) > 30 and time.perf_counter() - t0 >= 0.05  # a no-op is fast: time decides
    calls.clear()
    calibration._warm_up(lambda: (calls.append(1), time.sleep(0.01)), calls=30, seconds=0.05)
    assert len(calls) == 30  # a slow step: the count decides


def test_load_or_measure_caches_per_model(hs, model_path, random_draft_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path))
    calls = []
    real = calibration.measure

    def counting(*a, **kw):
        calls.append(1)
        kw["ns"] = [1, 2, 3]
        return real(*a, **kw)

    monkeypatch.setattr(calibration, "measure", counting)
    first = load_or_measure(hs.target, hs.draft, model_path, random_draft_path)
    path = cache_path(model_path, random_draft_path, hs.target.n_threads)
    assert path.is_file() and str(tmp_path) in str(path)
    again = load_or_measure(hs.target, hs.draft, model_path, random_draft_path)
    assert again == first and len(calls) == 1  # the second call read the file
    assert cache_path(model_path, None, hs.target.n_threads) != path  # another draft, another curve
    assert model_path.name in first.model and random_draft_path.name in first.model
    # a draft's curve written before the switch was measured prices drafting too cheaply: measured again
    data = json.loads(path.read_text())
    del data["draft_switch_ms"]
    path.write_text(json.dumps(data))
    load_or_measure(hs.target, hs.draft, model_path, random_draft_path)
    assert len(calls) == 2 and "draft_switch_ms" in json.loads(path.read_text())


def test_cli_calibrate(model_path, tmp_path):
    out = tmp_path / "curve.json"
    proc = subprocess.run([*CLI, "calibrate", model_path, "--repeats", "1", "--out", out],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln and ln[0].isdigit()]
    assert [int(r.split("\t")[0]) for r in rows] == list(range(1, 33))
    curve = CostCurve.from_json(out.read_text())
    assert curve.draft_step_ms == 0.0  # no draft given
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # what a draft must reach to pay here: a copied chain of k drafts costs t(k+1) / t(1) plain decodes
    lines = proc.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("break-even"))
    assert lines[at + 2].split() == ["k", *map(str, range(1, 9))]
    want = [curve.verify_time_ms(k + 1) / curve.verify_time_ms(1) for k in range(1, 9)]
    copies = [None if v == "-" else float(v) for v in lines[at + 3].split()[-8:]]
    assert copies == [None if w >= k + 1 else pytest.approx(w, abs=0.006) for k, w in zip(range(1, 9), want)]
    assert "draft model" not in proc.stdout  # no draft given: no draft rows


class ClockTarget:
    """A stand-in target whose decodes advance a fake clock: n rows cost n ms, and the one-row decodes right
    after a wider one 2, 1 and 0.5 ms more (llama.cpp rebuilding its graph for the narrower batch, then the
    host's caches or clocks settling)."""

    n_ctx, n_threads, kernels = 512, 1, ""
    AFTER_WIDE_MS = (2.0, 1.0, 0.5)

    def __init__(self) -> None:
        self.now, self.since_wide, self.n_past, self.embeddings = 0.0, 99, 0, False

    def tokenize(self, text, add_special=False, parse_special=False):
        return list(range(64))

    def reset(self) -> None:
        self.n_past = 0

    def set_embeddings(self, on: bool) -> None:
        self.embeddings = on

    def prefill(self, tokens):
        self.n_past = len(tokens)
        return np.zeros((len(tokens), 4), np.float32), None

    def verify(self, cand) -> None:
        n = len(cand)
        extra = self.AFTER_WIDE_MS[self.since_wide] if n == 1 and self.since_wide < len(self.AFTER_WIDE_MS) else 0.0
        self.now += 1e-3 * (n + extra)
        self.since_wide = 0 if n > 1 else self.since_wide + 1

    def rollback(self, n0: int) -> None:
        self.n_past = n0


def test_each_width_costs_what_it_adds_to_a_stream_of_plain_decodes(monkeypatch):
    """t(1) is a settled plain stream's decode, not a one-row decode after a wide one; t(n) carries what it
    costs the plain decodes after it, the graph rebuild and the slower decodes that follow.  Timed in
    isolation after random widths, t(1) came out 1.5x a plain stream's on the 2-core VM and auto drafted at
    a loss; timed with the next decode only, t(1) still came out 1.4x (the decodes after a wide one settle
    over several) and auto drafted at 0.82x of plain decoding."""
    target = ClockTarget()
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: target.now))
    curve = measure(target, None, ns=[1, 2, 4, 8], repeats=3, model="clock")
    assert curve.verify_ms == pytest.approx({1: 1.0, 2: 5.5, 4: 7.5, 8: 11.5})


def test_the_first_auto_run_measures_the_curve_outside_the_requests_timings(model_path, tmp_path, monkeypatch):
    """The first ``draft_len="auto"`` generation on a machine measures the cost curve (seconds, once); the request's
    prefill time, wall time and tokens/s are its own (they once counted the measurement as prefill)."""
    import shutil

    from hetero_spec.api import HeteroSpec

    spent: list[float] = []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = measure(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(calibration, "measure", timed)
    model = shutil.copy(model_path, tmp_path / "fresh.gguf")  # a file no curve is cached for
    with HeteroSpec(model, n_ctx=1024) as hs:  # no draft model: auto over the copy sources
        t0 = time.perf_counter()
        out = hs.generate("The capital of France is", max_new_tokens=8, draft_len="auto")
        elapsed = time.perf_counter() - t0
    assert len(spent) == 1 and out.stats.new_tokens == 8
    assert out.stats.prefill_s < out.stats.wall_s <= elapsed - spent[0]


def test_break_even_lines_set_a_trained_draft_s_own_estimate_beside_what_its_chains_need():
    """``calibrate MODEL DRAFT`` ends with what each chain length must reach here, for copies and for the draft's
    chains (its forwards priced as auto prices them), and the estimate the draft's trainer recorded."""
    from pathlib import Path

    from hetero_spec.bench.cli import break_even_lines
    from hetero_spec.draft.checkpoint import read_held_out_acceptance
    from hetero_spec.spec.policy import expected_emitted

    darter = Path(__file__).resolve().parents[2] / "drafts" / "smollm2-135m-darter.safetensors"
    curve = CostCurve({n: 5.0 + 4.0 * (n - 1) for n in range(1, 33)}, 0.3, {n: 0.3 + 0.05 * n for n in range(1, 33)},
                      draft_switch_ms=0.2)
    rows = {ln[:42].strip(): [None if v == "-" else float(v) for v in ln[42:].split()]
            for ln in break_even_lines(curve, darter).splitlines() if ln.startswith("  ") and not ln.startswith("  (")}
    copies, chain = rows["copied chains (suffix structure, lookup)"], rows["the draft model's chain"]
    # t(k+1) / t(1) = 1 + 0.8 k: within reach of a round's k + 1 tokens at every k
    assert copies == pytest.approx([(5.0 + 4.0 * k) / 5.0 for k in range(1, 9)], abs=0.006)
    assert all(c > p for c, p in zip(chain, copies))  # a draft forward per depth on top of the same rows
    steep = CostCurve({n: 5.0 * n for n in range(1, 33)}, 0.3, {n: 0.3 for n in range(1, 33)})  # a row costs a decode
    never = next(ln for ln in break_even_lines(steep, None).splitlines() if ln.startswith("  copied"))
    assert never[42:].split() == ["-"] * 8 and "draft model" not in break_even_lines(steep, None)
    alphas = read_held_out_acceptance(darter)
    assert len(alphas) >= 3
    assert rows["this draft, its trainer's estimate"] == pytest.approx(
        [expected_emitted(list(alphas[:k])) for k in range(1, min(8, len(alphas)) + 1)], abs=0.006)
