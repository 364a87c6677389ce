"""``train`` under torchrun: two CPU processes on gloo, on features of a tiny real GGUF.

What DDP must give: the ranks take the steps that one process with ``--grad-accum 2`` takes over the
same batches (gradients averaged, parameters in step), across an epoch boundary with an odd number of
batches; rank 0 alone writes the checkpoint, the draft and the summary; and a time budget, which each
rank's clock measures differently, stops every rank at the same step instead of leaving one waiting in
an all-reduce.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.draft.checkpoint import load_draft
from hetero_spec.train.data import load_split, make_batches
from hetero_spec.train.loop import TrainConfig, train
from hetero_spec.train_cli import _target_parts
from tests.feature_builder import build_features

ROOT = Path(__file__).resolve().parents[2]
# Every file a process opens for writing, or renames into place, under $WRITE_LOG_UNDER, logged with the
# process's RANK: Python's audit events see the writes of torch.save and the renames of save_draft.
AUDIT = r"""
import os, sys
_under, _log = os.environ.get("WRITE_LOG_UNDER"), os.environ.get("WRITE_LOG")
def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and set(args[1] or "r") & set("wax+"):
        path = str(args[0])
    elif event == "os.rename":
        path = str(args[1])
    else:
        return
    if path.startswith(_under):
        with open(_log, "a", buffering=1) as fh:  # mode "a" of the log itself is outside _under
            fh.write(f"{os.environ.get('RANK', '-')} {path}\n")
if _under and _log:
    sys.addaudithook(_hook)
"""
# FLAGS as a TrainConfig (the rest at the CLI's defaults), made deterministic (no input noise, no holes,
# every chain) so that two runs of the same steps can be compared; fp32, as bf16 autocast depends on the CPU
BASE = TrainConfig(variant="darter", n_blocks=1, reduced_vocab=256, lr=3e-3, batch_tokens=384, unroll_steps=2,
                   noise=0.0, hole_prob=0.0, checkpoint_every=2, threads=1, device="cpu", precision="fp32", seed=0)
FLAGS = ["--blocks", "1", "--reduced-vocab", "256", "--lr", "3e-3", "--batch-tokens", "384", "--unroll", "2",
         "--noise", "0", "--hole-prob", "0", "--checkpoint-every", "2", "--threads", "1", "--device", "cpu",
         "--precision", "fp32", "--seed", "0"]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from hetero_spec.tiny_models import tiny_model_path

    return tiny_model_path("llama", "Q8_0")


@pytest.fixture(scope="module")
def features(tiny_model, tmp_path_factory) -> Path:
    prompts = bench_prompts("alpaca", 8) + bench_prompts("gsm8k", 8)
    return build_features(tiny_model, tmp_path_factory.mktemp("ddp-features"), prompts, max_new_tokens=48)


def torchrun(args: list[str], tmp_path: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m torch.distributed.run --nproc_per_node 2 -m hetero_spec train ...`` with each rank's
    output in its own file and every write under tmp_path logged with its rank."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AUDIT)
    log = tmp_path.parent / f"{tmp_path.name}-writes.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "WRITE_LOG_UNDER": str(tmp_path / "out"), "WRITE_LOG": str(log), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "-m", "hetero_spec", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return proc, log


def rank_output(tmp_path: Path, rank: int, stream: str) -> str:
    (path,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}/{stream}.log")
    return path.read_text()


def test_two_ranks_take_the_steps_of_one_process_with_grad_accum_2_and_rank_0_alone_writes(
        tiny_model, features, tmp_path):
    split = load_split(features, max_len=BASE.max_len, held_out=BASE.held_out, seed=BASE.seed)
    count = lambda bt: len(make_batches(split.train, bt, BASE.seed, 0))  # noqa: E731
    # an odd number of batches in the first epoch: split by rank, one rank would have one more
    batch_tokens = next((bt for bt in range(256, 1024, 32) if count(bt) % 2), None)
    assert batch_tokens is not None
    steps = count(batch_tokens) // 2 + 2  # into the second epoch
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "ddp.safetensors"
    proc, log = torchrun([str(features), "--target", str(tiny_model), "--out", str(out), "--max-steps", str(steps),
                          *FLAGS, "--batch-tokens", str(batch_tokens)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + rank_output(tmp_path, 1, "stderr")[-2000:]
    summary = json.loads(rank_output(tmp_path, 0, "stdout")[rank_output(tmp_path, 0, "stdout").index("{"):])
    assert summary["steps"] == steps and summary["epochs"] == 1
    assert rank_output(tmp_path, 1, "stdout").strip() == ""  # rank 0 alone reports

    writes = [line.split(" ", 1) for line in log.read_text().splitlines()]
    written = {Path(p).name for _, p in writes}
    assert {"checkpoint.pt", "ddp.safetensors", "history.json"} <= written
    assert {r for r, _ in writes} == {"0"}, f"ranks other than 0 wrote: {[w for w in writes if w[0] != '0']}"
    ckpt = torch.load(tmp_path / "out" / "ddp.train" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ckpt["state"]["step"] == steps

    # the same steps in one process, two batches accumulated per step: the same draft, up to the order
    # of float sums (the drafts are saved in bf16)
    fp, emb, head = _target_parts(tiny_model)
    single = tmp_path / "single.safetensors"
    base = replace(BASE, batch_tokens=batch_tokens)
    train(replace(base, max_steps=steps, grad_accum=2), features, single, embedding=emb, head=head, fingerprint=fp,
          progress=False)
    assert load_draft(out, fp).cfg == load_draft(single, fp).cfg
    # ... and not because any two runs end alike: one process with one batch per step ends elsewhere
    other = tmp_path / "accum1.safetensors"
    train(replace(base, max_steps=steps), features, other, embedding=emb, head=head, fingerprint=fp, progress=False)
    a, b, c = (weights(tmp_path / name) for name in ("out/ddp.train", "single.train", "accum1.train"))
    same, elsewhere = float((a - b).norm() / a.norm()), float((a - c).norm() / a.norm())
    assert same < 1e-4 and elsewhere > 30 * same, (same, elsewhere)


def weights(train_dir: Path) -> torch.Tensor:
    """Every trained float weight of a run, flat, in fp32 from its checkpoint (the draft file is bf16)."""
    ck = torch.load(train_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    return torch.cat([v.flatten().float() for k, v in sorted(ck.items()) if v.is_floating_point()])


def test_a_time_budget_stops_every_rank_at_the_same_step(tiny_model, features, tmp_path):
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "budget.safetensors"
    proc, _ = torchrun([str(features), "--target", str(tiny_model), "--out", str(out), "--max-steps", "100000",
                        "--time-budget", "0.05", *FLAGS], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((tmp_path / "out" / "budget.train" / "history.json").read_text())
    steps = max(h["step"] for h in history if "loss" in h)
    assert 1 < steps < 100000 and load_draft(out).cfg.n_blocks == 1
