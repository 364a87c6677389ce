"""Distillation on a small self-distilled set exported from the real GGUF."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.draft.checkpoint import load_draft
from hetero_spec.errors import HeteroSpecError
from hetero_spec.train.loop import MAX_NONFINITE_STEPS, TrainConfig, TrainingDiverged, train
from hetero_spec.train_cli import _target_parts
from tests.feature_builder import build_features

BASE = TrainConfig(variant="darter", n_blocks=1, reduced_vocab=512, epochs=100, lr=3e-3, warmup_steps=5,
                   batch_tokens=1024, unroll_steps=2, chain_sample=0.5, held_out=0.2, checkpoint_every=5, threads=1,
                   seed=3)


@pytest.fixture(scope="module")
def parts(model_path):
    return _target_parts(model_path)


@pytest.fixture(scope="module")
def features(model_path, tmp_path_factory):
    prompts = bench_prompts("alpaca", 6) + bench_prompts("gsm8k", 4)
    return build_features(model_path, tmp_path_factory.mktemp("features"), prompts, max_new_tokens=40)


def run(cfg, features, out, parts, resume=False):
    fp, emb, head = parts
    return train(cfg, features, out, embedding=emb, head=head, fingerprint=fp, resume=resume, progress=False)


def test_tiny_training_lowers_the_loss_and_saves_a_loadable_draft(features, parts, tmp_path):
    out = tmp_path / "d.safetensors"
    summary = run(replace(BASE, max_steps=40, eval_every=20), features, out, parts)
    history = json.loads((tmp_path / "d.train" / "history.json").read_text())
    assert {20, 40} <= {h["step"] for h in history if "eval" in h}
    losses = [h["loss"] for h in history if "loss" in h]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert (tmp_path / "d.train" / "training.png").stat().st_size > 1000
    eval_steps = [h["step"] for h in history if "eval" in h]
    assert eval_steps[-1] == 40 and len(eval_steps) == len(set(eval_steps))  # the end's evaluation, once
    draft = load_draft(out, parts[0])  # fingerprint accepted
    assert draft.cfg.reduced_vocab == 512 and draft.cfg.gate == "darter"
    assert len(set(draft.d2t.tolist())) == 512
    with safe_open(str(out), "pt") as fh:
        meta = json.loads(fh.metadata()["hetero_spec.training"])
    assert meta["steps"] == 40 and 0 < meta["vocab_coverage"] <= 1 and meta["eval"]["accepted_length"] >= 1.0
    hist = tmp_path / "d.train" / "history.json"
    compare = [sys.executable, "-m", "hetero_spec", "bench", "training"]
    done = subprocess.run([*compare, str(hist), str(hist), "--out", str(tmp_path / "c.png")], capture_output=True, text=True)
    assert done.returncode == 0 and (tmp_path / "c.png").stat().st_size > 1000
    bad = subprocess.run([*compare, str(out), "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert bad.returncode != 0 and "not a readable training history" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.png").exists()
    assert summary["steps"] == 40 and 0 < summary["train_cpu_seconds"]
    state = torch.load(tmp_path / "d.train" / "checkpoint.pt", map_location="cpu", weights_only=False)
    state = state.get("state", state)  # the budget clock sums each step once, per thread
    assert state["cpu_thread_s"] * torch.get_num_threads() == pytest.approx(state["cpu_s"], rel=1e-6)
    latest = tmp_path / "d.train" / "latest.safetensors"  # the draft as of the last evaluation
    with safe_open(str(latest), "pt") as fh:
        assert json.loads(fh.metadata()["hetero_spec.training"]) == {"partial": True, "steps": 40}
    assert load_draft(latest, parts[0]).cfg == draft.cfg


def test_a_diverging_run_stops_with_one_line_and_writes_no_draft(features, parts, tmp_path):
    """A learning rate that blows the weights up makes the loss NaN from then on: the NaN steps are skipped
    (weights and optimizer untouched), and a run of them stops training instead of saving a draft of NaNs."""
    out = tmp_path / "d.safetensors"
    with pytest.raises(TrainingDiverged, match=rf"not finite for {MAX_NONFINITE_STEPS} steps in a row") as err:
        run(replace(BASE, max_steps=40, lr=1e30, warmup_steps=0), features, out, parts)
    assert "\n" not in str(err.value) and not out.exists()
    step = int(re.search(r"diverged at step (\d+)", str(err.value)).group(1))
    state = torch.load(tmp_path / "d.train" / "checkpoint.pt", map_location="cpu", weights_only=False)["state"]
    steps = [h for h in state["history"] if "eval" not in h]  # the last checkpoint's: a few skipped steps
    first = next(h["step"] for h in steps if h.get("skipped"))
    assert all(h.get("skipped") for h in steps if h["step"] >= first) and "loss" in steps[0]
    assert step == first + MAX_NONFINITE_STEPS - 1  # one run of skipped steps, from the first to the stop


def test_resume_continues_from_the_checkpoint(features, parts, tmp_path):
    straight = tmp_path / "a.safetensors"
    run(replace(BASE, max_steps=12), features, straight, parts)
    split = tmp_path / "b.safetensors"
    run(replace(BASE, max_steps=12, time_budget_s=1e-9), features, split, parts)  # stops after one step
    first = json.loads((tmp_path / "b.train" / "history.json").read_text())
    assert [h["step"] for h in first if "loss" in h] == [1]
    with safe_open(str(split), "pt") as fh:  # the last evaluation, the draft's own, ends the curves
        final = json.loads(fh.metadata()["hetero_spec.training"])["eval"]
    assert [h["step"] for h in first if "eval" in h] == [1]
    assert [h for h in first if "eval" in h][0]["eval"]["step_top1"] == final["step_top1"]
    run(replace(BASE, max_steps=12), features, split, parts, resume=True)
    a, b = load_draft(straight), load_draft(split)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name)


def test_init_from_continues_a_finished_draft_with_its_weights_and_head_rows(features, parts, tmp_path):
    first = tmp_path / "a.safetensors"
    run(replace(BASE, max_steps=12, reduced_vocab=256), features, first, parts)
    # lr 0: the continued draft can only equal the first if its weights and head rows were adopted
    # (a fresh start with the same seed would hold the first run's *initial* weights)
    then = tmp_path / "b.safetensors"
    summary = run(replace(BASE, max_steps=2, lr=0.0, init_from=str(first)), features, then, parts)
    a, b = load_draft(first), load_draft(then)
    assert a.cfg == b.cfg
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    assert summary["init_from"]["file"] == "a.safetensors" and summary["init_from"]["steps"] == 12
    with pytest.raises(HeteroSpecError, match=r"cannot continue from a.safetensors: its n_blocks 1 \(options: 2\)"):
        run(replace(BASE, n_blocks=2, max_steps=1, init_from=str(first)), features, tmp_path / "c.safetensors", parts)


def test_sigterm_stops_the_cli_at_a_step_boundary_with_a_checkpoint_and_a_draft(features, parts, model_path, tmp_path):
    out = tmp_path / "d.safetensors"
    ckpt = tmp_path / "d.train" / "checkpoint.pt"
    proc = subprocess.Popen([sys.executable, "-m", "hetero_spec", "train", str(features), "--target", str(model_path),
                             "--out", str(out), "--blocks", "1", "--reduced-vocab", "512", "--batch-tokens", "1024",
                             "--unroll", "2", "--max-steps", "100000", "--checkpoint-every", "1", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ckpt.exists(), proc.communicate(timeout=5)[1] if proc.poll() is not None else "no step in 300 s"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert "stopped by SIGTERM after step" in err and "--resume" in err
    with safe_open(str(out), "pt") as fh:
        meta = json.loads(fh.metadata()["hetero_spec.training"])
    assert meta["stopped_by"] == "SIGTERM" and 1 <= meta["steps"] < 100000
    assert torch.load(ckpt, weights_only=False)["state"]["step"] == meta["steps"]  # nothing trained past the save
    summary = run(replace(BASE, max_steps=meta["steps"] + 2), features, out, parts, resume=True)
    assert summary["steps"] == meta["steps"] + 2 and summary["stopped_by"] is None


def test_features_from_another_target_are_refused(features, parts, tmp_path):
    fp, emb, head = parts
    other = replace(fp, tokenizer_sha256="0" * 64)
    with pytest.raises(HeteroSpecError, match="another target"):
        train(BASE, features, tmp_path / "x.safetensors", embedding=emb, head=head, fingerprint=other, progress=False)


def test_train_cli_refuses_a_missing_dataset_in_one_line(model_path, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hetero_spec", "train", str(tmp_path), "--target", str(model_path),
                           "--out", str(tmp_path / "d.safetensors")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "not a feature dataset" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_folder_without_the_drafts_taps_is_refused_naming_the_commands_that_make_them(features):
    """Features exported from text (``export-features`` without ``--corpus``) hold no block inputs: training a
    draft with taps on them is refused in one line that names the commands which do store them."""
    from hetero_spec.errors import HeteroSpecError
    from hetero_spec.train.data import load_split

    with pytest.raises(HeteroSpecError) as err:
        load_split(features, max_len=1024, held_out=0.2, seed=3, taps=(2, 15, 27))
    msg = str(err.value)
    assert "holds no tap_2, tap_15, tap_27" in msg and "\n" not in msg
    assert "generate-corpus --taps 2,15,27" in msg and "export-features --corpus FOLDER --taps 2,15,27" in msg


def test_several_folders_train_together_and_each_keeps_its_own_held_out_split(features):
    from hetero_spec.train.data import load_split

    one = load_split(features, max_len=1024, held_out=0.2, seed=3)
    two = load_split([features, features], max_len=1024, held_out=0.2, seed=3)
    assert len(two.train) == 2 * len(one.train) and len(two.held_out) == 2 * len(one.held_out)
    for a, b in zip(one.held_out, two.held_out[len(one.held_out):]):
        assert (a.input_ids == b.input_ids).all()


def test_loop_trimming_keeps_the_held_out_split_and_only_removes_scored_loop_tokens(features):
    from hetero_spec.train.data import load_split

    plain = load_split(features, max_len=1024, held_out=0.2, seed=3)
    trimmed = load_split(features, max_len=1024, held_out=0.2, seed=3, loop_keep=2)
    for a_list, b_list in ((plain.train, trimmed.train), (plain.held_out, trimmed.held_out)):
        assert len(a_list) == len(b_list)
        for a, b in zip(a_list, b_list):  # the same sequences, each a prefix of its untrimmed self
            assert len(b) <= len(a) and (a.input_ids[: len(b)] == b.input_ids).all()
            assert (b.loss_mask <= a.loss_mask[: len(b)]).all()
    scored = lambda seqs: sum(int(s.loss_mask.sum()) for s in seqs)  # noqa: E731
    assert scored(trimmed.train) < scored(plain.train)  # greedy answers of a 135M model do loop


def test_bf16_autocast_changes_the_arithmetic_but_not_the_loss_materially(features, parts):
    from hetero_spec.draft.model import DraftModel, init_weights
    from hetero_spec.train.data import collate, load_split
    from hetero_spec.train.loop import _Unrolled, _batch_loss, _draft_config

    fp, emb, head = parts
    split = load_split(features, max_len=1024, held_out=0.0, seed=0)
    d2t = torch.arange(512) * 7
    model = init_weights(DraftModel(_draft_config(BASE, fp, d2t)), 0)
    model.d2t = d2t
    model.attach_target_weights(emb, head)
    batch = collate(split.train[:3])
    losses = [_batch_loss(_Unrolled(model, 2), model, batch, BASE, None, bf16)[0].item() for bf16 in (False, True)]
    assert losses[0] != losses[1]
    assert abs(losses[0] - losses[1]) < 0.02 * abs(losses[0])
