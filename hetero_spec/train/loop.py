"""The distillation trainer: AdamW, warmup + cosine decay, clipping, accumulation, checkpoints,
resume, a wall-clock budget, held-out evaluation, and DistributedDataParallel under torchrun.

Launch on several GPUs with ``torchrun --nproc_per_node N -m hetero_spec train ...``: the
process group comes from torchrun's environment (NCCL on CUDA, gloo on CPUs), each rank takes every
N-th batch (the same number on every rank), rank 0 alone evaluates and writes checkpoints and the
draft, and the ranks agree each step on whether to stop (time budget, signal) so that none waits
on a collective the others left.  N ranks with ``--grad-accum 1`` take the steps one process with
``--grad-accum N`` would take (tests/integration/test_ddp.py).
"""
from __future__ import annotations

import gc
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import atomic_file
from ..config import ConfigError, DraftConfig, TargetFingerprint, draft_config_for
from ..draft.checkpoint import TRAINING_KEY, load_draft, read_metadata, save_draft
from ..draft.model import DraftModel, init_weights
from ..cpu_features import cpu_has_bf16
from ..errors import HeteroSpecError
from ..features import read_manifest
from .data import Batch, choose_vocab, collate, load_split, make_batches, tap_keys
from .losses import LossWeights, gate_regularization, step_loss
from .stop import StopRequest
from .unroll import unrolled_forward

# Steps in a row whose gradients are not finite before training stops as diverged.  One such step (a bf16
# overflow, one odd batch) is skipped as PyTorch's GradScaler skips it, leaving weights and optimizer state
# untouched; a run of them means the weights themselves went bad, and saving them would write a useless draft.
MAX_NONFINITE_STEPS = 8


class TrainingDiverged(HeteroSpecError):
    """The loss's gradients stayed NaN or infinite: nothing is written to OUT."""


@dataclass(frozen=True)
class TrainConfig:
    variant: str = "darter"  # darter | dovetail | eagle (presets in config.DRAFT_PRESETS)
    n_blocks: int | None = None  # default from the preset
    reduced_vocab: int = 8192
    epochs: int = 4
    max_steps: int = 0  # 0 = epochs decide
    time_budget_s: float = 0.0  # stop (and save) after this much training time; 0 = none
    # what the budget (and the lr schedule that follows it) counts: "wall" seconds of the steps, or "cpu"
    # seconds of the steps divided by the torch threads, which a machine shared with other jobs does
    # not inflate (the compute a run actually got)
    budget_clock: str = "wall"
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    batch_tokens: int = 4096
    grad_accum: int = 1
    clip: float = 0.5
    unroll_steps: int = 3  # EAGLE-3 style: the draft consumes its own outputs for this many steps
    # share of the chain starts that the unrolled steps (1..) continue; step 0 always scores every row.
    # A sample costs proportionally less and still shows the draft its own features
    chain_sample: float = 1.0
    taps: tuple[int, ...] = ()  # target block inputs the draft reads (EAGLE-3 fusion); () = final hidden state
    # Share of training sequences whose prompt is a hole (no keys, no loss before the first answer token),
    # as the runtime's lazy prefill leaves it when auto does not expect to draft.
    hole_prob: float = 0.3
    init_from_target: bool = False  # the last draft block starts as the target's last block (see init_block)
    # A draft file whose weights, head rows and tap scale this run starts from (fresh optimizer and lr
    # schedule): continue a shipped draft on new data when its checkpoint folder is gone
    init_from: str = ""
    noise: float = 0.05  # input feature noise, as a fraction of the features' RMS (EAGLE)
    max_len: int = 1024
    # > 0: a repetition loop in the answers keeps this many scored tokens, the rest are unscored and a
    # sequence ends at its last scored token (loops.py: greedy self-distilled answers loop a lot)
    loop_keep: int = 0
    held_out: float = 0.03
    max_held_out: int = 256  # sequences; evaluation runs the full target head on every position
    eval_chain: int = 4  # teacher-forced accepted-length estimate for chain k = this
    checkpoint_every: int = 200
    eval_every: int = 0  # steps between held-out evaluations (0: after each epoch only)
    seed: int = 0
    device: str = "auto"
    threads: int = 0  # CPU threads for torch (0 = all cores)
    precision: str = "auto"  # auto = bf16 autocast on CUDA and on CPUs with native bf16; "bf16" | "fp32"
    loss: LossWeights = field(default_factory=LossWeights)


@dataclass
class EvalResult:
    top1: float  # step 0: the draft's argmax equals the target's (full-vocabulary head on f_{t+1})
    accepted_length: float  # teacher-forced mean accepted length at chain k (bonus token included)
    loss: float
    step_top1: list[float] = field(default_factory=list)  # per unrolled step j, given steps < j accepted


def train(
    cfg: TrainConfig,
    features_dirs: str | Path | list,
    out: str | Path,
    *,
    embedding: torch.Tensor,
    head: torch.Tensor,
    fingerprint: TargetFingerprint,
    resume: bool = False,
    progress: bool = True,
    init_block: dict | None = None,
) -> dict:
    """Distil a draft from one or more feature folders into ``out`` (safetensors); returns a summary dict.

    embedding / head: [n_vocab, n_embd] float32 from the target GGUF (frozen, never saved).
    init_block: a target block's weights in HF layout (``gguf_weights.load_block``), copied into the
    draft's last block before training when ``cfg.init_from_target``.
    """
    out = Path(out)
    work = out.with_suffix(".train")
    work.mkdir(parents=True, exist_ok=True)
    rank, world, local_rank, owns_group = _init_distributed()
    device = _device(cfg.device, local_rank)
    if device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    _seed_everything(cfg.seed + rank)
    features_dirs = [features_dirs] if isinstance(features_dirs, (str, Path)) else list(features_dirs)
    for folder in features_dirs:
        diffs = fingerprint.mismatches(read_manifest(folder).fingerprint)
        if diffs:
            raise HeteroSpecError(f"features in {folder} come from another target: " + "; ".join(diffs))
    split = load_split(features_dirs, max_len=cfg.max_len, held_out=cfg.held_out, seed=cfg.seed, taps=cfg.taps,
                       loop_keep=cfg.loop_keep)
    split.held_out = split.held_out[: cfg.max_held_out]
    if not split.train:
        raise HeteroSpecError(f"{', '.join(map(str, features_dirs))} hold no usable training sequences")
    autocast_bf16 = _use_bf16(cfg.precision, device)
    d2t, coverage = choose_vocab(split.train, cfg.reduced_vocab or fingerprint.n_vocab, fingerprint.n_vocab)
    ckpt = work / "checkpoint.pt"
    resuming = resume and ckpt.exists()
    start = _start_draft(cfg, fingerprint) if cfg.init_from and not resuming else None
    if resuming:  # the head rows chosen when training began, even if the data grew since
        d2t = torch.load(ckpt, map_location="cpu", weights_only=False)["model"].get("d2t", d2t)
    elif start is not None:
        d2t = start.d2t.clone()
    dcfg = _draft_config(cfg, fingerprint, d2t)
    model = init_weights(DraftModel(dcfg), cfg.seed)
    if start is not None:
        _adopt(model, start, Path(cfg.init_from).name)
    if cfg.init_from_target:
        if init_block is None:
            raise HeteroSpecError("init_from_target needs the target block's weights (init_block)")
        copy_block(model.blocks[-1], init_block)
    model.d2t = d2t
    model.attach_target_weights(embedding, head)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = max(1, len(make_batches(split.train, cfg.batch_tokens, cfg.seed, 0)) // (cfg.grad_accum * world))
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    lr_at = _warmup_cosine(cfg.warmup_steps, total, cfg.time_budget_s)
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "train_s": 0.0, "history": []}
    if resuming:
        state = _load_checkpoint(ckpt, model, opt)
    runner = _Unrolled(model, cfg.unroll_steps)
    if world > 1:
        runner = _ddp(runner, device)
    feat_rms = _feature_rms(split.train, cfg.taps).to(device)
    if cfg.taps and not resuming and start is None:  # a continued draft keeps the scale it was trained with
        model.tap_scale.copy_(tap_scale_for(feat_rms))
    held_targets: dict[int, torch.Tensor] = {}  # the target's argmax per held-out batch (evaluate)
    bar = tqdm(total=total, initial=state["step"], disable=not progress or rank != 0, unit="step", dynamic_ncols=True)
    done = state["step"] >= total
    bad_run = 0  # steps in a row skipped for gradients that were not finite
    # Ctrl-C / SIGTERM: finish the step, save, export (under DDP every rank stops at the same step: _agree)
    with StopRequest() as stop:
        while not done:
            batches = _rank_batches(make_batches(split.train, cfg.batch_tokens, cfg.seed, state["epoch"]), rank, world)
            for bi in range(state["batch_in_epoch"], len(batches) - len(batches) % cfg.grad_accum, cfg.grad_accum):
                t0, c0 = time.perf_counter(), time.process_time()
                opt.zero_grad(set_to_none=True)
                agg = {"loss": 0.0, "correct": 0, "count": 0}
                for a in range(cfg.grad_accum):
                    idx = batches[bi + a]
                    batch = collate([split.train[i] for i in idx], cfg.taps, np.random.random(len(idx)) < cfg.hole_prob)
                    batch = batch.to(device)
                    loss, correct, count, parts = _batch_loss(runner, model, batch, cfg, feat_rms, autocast_bf16)
                    (loss / cfg.grad_accum).backward()
                    agg["loss"] += loss.item() / cfg.grad_accum
                    agg["correct"] += correct
                    agg["count"] += count
                # identical on every rank under DDP (the gradients are all-reduced), so all ranks skip together
                finite = bool(torch.isfinite(torch.nn.utils.clip_grad_norm_(params, cfg.clip)))
                lr = cfg.lr * lr_at(state["step"], _spent(state, cfg))
                for group in opt.param_groups:
                    group["lr"] = lr
                if finite:
                    opt.step()
                    bad_run = 0
                else:
                    bad_run += 1
                    state["skipped_steps"] = state.get("skipped_steps", 0) + 1
                    if bad_run >= MAX_NONFINITE_STEPS:
                        bar.close()
                        raise TrainingDiverged(
                            f"training diverged at step {state['step'] + 1}: the gradients were not finite for "
                            f"{bad_run} steps in a row (learning rate {cfg.lr:g}); nothing was written to {out} "
                            "(lower --lr and start again)")
                state["step"] += 1
                state["batch_in_epoch"] = bi + cfg.grad_accum
                state["train_s"] += time.perf_counter() - t0
                # CPU seconds of the steps: on a shared machine the wall clock overstates the work
                _add_step_cpu(state, time.process_time() - c0, torch.get_num_threads())
                acc = agg["correct"] / max(1, agg["count"])
                state["history"].append({"step": state["step"], "loss": agg["loss"], "acc": acc, **parts} if finite
                                        else {"step": state["step"], "skipped": "gradients not finite"})
                if cfg.time_budget_s:  # the bar's total (and ETA) is what the budget buys at this pace
                    bar.total = min(total, max(state["step"], round(state["step"] * cfg.time_budget_s
                                                                    / max(1e-9, _spent(state, cfg)))))
                bar.update(1)
                bar.set_postfix(loss=f"{agg['loss']:.3f}", acc=f"{acc:.3f}", lr=f"{lr:.1e}")
                out_of_time = bool(cfg.time_budget_s and _spent(state, cfg) >= cfg.time_budget_s)
                if world > 1:  # rank 0's clock decides, and a signal on any rank stops them all
                    out_of_time, stopping = _agree(out_of_time, stop.requested, device)
                    if stopping and not stop.requested:
                        stop.signal_name = "SIGTERM"
                if rank == 0 and cfg.eval_every and state["step"] % cfg.eval_every == 0 and split.held_out:
                    _record_eval(state, evaluate(model, split.held_out, cfg, device, head, held_targets), bar)
                    # the draft so far, usable (bench, run) while training goes on; the end replaces it
                    save_draft(model, work / "latest.safetensors", dtype=torch.bfloat16,
                               extra={TRAINING_KEY: json.dumps({"partial": True, "steps": state["step"]})})
                if rank == 0 and (state["step"] % cfg.checkpoint_every == 0 or out_of_time or stop.requested):
                    _save_checkpoint(ckpt, model, opt, state)
                if state["step"] >= total or out_of_time or stop.requested:
                    done = True
                    break
            else:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                if rank == 0 and split.held_out and _eval_now(state) is None:
                    _record_eval(state, evaluate(model, split.held_out, cfg, device, head, held_targets), bar)
        bar.close()
        summary = {}
        if rank == 0:
            _save_checkpoint(ckpt, model, opt, state)
            if split.held_out and _eval_now(state) is None:  # after the checkpoint: it saved the RNG
                _record_eval(state, evaluate(model, split.held_out, cfg, device, head, held_targets), bar)
            ev = _eval_now(state)  # the curves end where the draft does; evaluation is deterministic
            summary = {
                "variant": cfg.variant, "steps": state["step"], "epochs": state["epoch"],
                "stopped_by": stop.signal_name or None,
                "train_seconds": round(state["train_s"], 1), "train_cpu_seconds": round(state.get("cpu_s", 0.0), 1),
                "train_sequences": len(split.train),
                "train_tokens": int(sum(len(s) for s in split.train)),
                "held_out_sequences": len(split.held_out), "vocab_coverage": round(coverage, 4),
                "eval": ev["eval"] if ev else None, "config": _jsonable(asdict(cfg)),
                **({"init_from": _prior_training(Path(cfg.init_from))} if cfg.init_from else {}),
            }
            save_draft(model, out, extra={TRAINING_KEY: json.dumps(summary)}, dtype=torch.bfloat16)
            atomic_file.write_text(work / "history.json", json.dumps(state["history"]))
            _plot_history(state["history"], work / "training.png")
    if owns_group:
        runner = None  # DDP and its reducer go before the group they reduce over (_leave_group)
        _leave_group()
    return summary


def _batch_loss(runner, model: DraftModel, batch: Batch, cfg: TrainConfig, feat_rms: torch.Tensor | None,
                bf16: bool = False):
    """runner: the (possibly DDP-wrapped) unrolled forward; ``feat_rms`` [n_in] (the inputs' per-channel
    RMS) adds noise of ``cfg.noise`` times each channel's RMS, None none; ``bf16``
    autocasts the forward and the head matmuls of the losses (autocast keeps softmaxes in fp32).

    Only scored rows are computed (``unroll.py``): step 0 where x_{s+2} is an answer token, and the
    unrolled steps from a ``cfg.chain_sample`` share of those chain starts."""
    inputs = batch.inputs
    if feat_rms is not None and cfg.noise > 0:
        inputs = inputs + torch.randn_like(inputs) * (cfg.noise * feat_rms)
    T = batch.ids.shape[1]
    pos = torch.arange(T, device=inputs.device)
    scored = batch.loss_mask & batch.valid
    seen = pos[None, :] >= batch.holes[:, None]  # queries that exist at inference
    queries = _shift(scored, 2) & seen
    chains = None
    if cfg.unroll_steps > 1 and cfg.chain_sample < 1.0:
        chains = queries & _shift(scored, 3) & (torch.rand(queries.shape, device=inputs.device) < cfg.chain_sample)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        steps = runner(inputs, batch.next_tokens, batch.valid, batch.holes, queries, chains)
    total = torch.zeros((), device=inputs.device)
    correct = count = 0
    parts: dict[str, float] = {}
    for j, st in enumerate(steps):
        # step j at chain s predicts f_{s+j+1} and (through the head) x_{s+j+2}
        tgt_feat = _gather_rows(batch.features, (st.pos + j + 1).clamp_max(T - 1))
        ahead = st.pos + j + 2
        mask = st.live & (ahead < T) & scored.gather(1, ahead.clamp_max(T - 1)) & seen.gather(1, st.pos)
        with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
            sl = step_loss(st.features, tgt_feat, mask, model.head, cfg.loss)
        weight = cfg.loss.step_decay**j
        total = total + weight * sl.total
        if j == 0:
            correct, count, parts = sl.correct, sl.count, sl.parts
        if cfg.loss.recipe == "darter" and cfg.loss.gate > 0 and st.log_gates:
            total = total + weight * cfg.loss.gate * gate_regularization(st.log_gates, st.gate_rows, cfg.loss.keep_ratio)
    return total, correct, count, parts


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, d] -> x[b, idx[b, n]] as [B, N, d]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


@torch.no_grad()
def evaluate(model: DraftModel, seqs, cfg: TrainConfig, device, full_head: torch.Tensor,
             targets: dict[int, torch.Tensor] | None = None) -> EvalResult:
    """Held-out, teacher-forced, scored as verification scores: against the target's own argmax, its
    full-vocabulary head applied to f_{t+1} (not the data's next token, which on text the target did
    not write is someone else's).  top-1 at step 0, top-1 per unrolled step given the steps before
    it were accepted, and the mean accepted length of chain k = eval_chain for every chain start
    (leading steps whose argmax is the target's, plus the bonus token).

    ``targets``: a cache of the target's argmax per held-out batch, filled on the first call; the
    full-vocabulary head over every held-out row is most of an evaluation's cost, and never changes."""
    model.eval()
    k = cfg.eval_chain
    head = full_head.to(device)
    hits = torch.zeros(k, device=device)
    tries = torch.zeros(k, device=device)
    accepted: list[torch.Tensor] = []
    losses = []
    targets = {} if targets is None else targets
    for n, idx in enumerate(make_batches(seqs, cfg.batch_tokens, cfg.seed, 0)):
        batch = collate([seqs[i] for i in idx], cfg.taps).to(device)
        T = batch.ids.shape[1]
        pos = torch.arange(T, device=device)
        steps = unrolled_forward(model, batch.inputs, batch.next_tokens, batch.valid, k)
        loss, _, _, _ = _batch_loss(_Unrolled(model, 1), model, batch, cfg, None)
        losses.append(loss.item())
        if n not in targets:
            targets[n] = _argmax_rows(batch.features, head)  # [B, T]: the target's x_{t+1} after f_t
        target_next = targets[n]
        start = _shift(batch.loss_mask & batch.valid, 2) & (pos < T - 2)
        run = start.clone()
        length = torch.zeros(batch.ids.shape, device=device)
        for j, st in enumerate(steps):
            pred = model.d2t[(st.features @ model.head.t()).argmax(-1)]
            live = run & _shift(batch.valid, j + 2) & (pos < T - j - 2)
            ok = live & (pred == _shift(target_next, j + 1))
            hits[j] += ok.sum()
            tries[j] += live.sum()
            run = ok
            length = length + run.float()
        accepted.append(length[start])
    model.train()
    acc_len = 1.0 + torch.cat(accepted).mean().item() if accepted else 1.0
    step_top1 = (hits / tries.clamp_min(1)).tolist()
    return EvalResult(top1=step_top1[0], accepted_length=acc_len, loss=float(np.mean(losses)), step_top1=step_top1)


def _argmax_rows(feats: torch.Tensor, head: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """argmax(feats @ head.T) over the last axis, a few rows at a time: a full head (262k rows for Gemma)
    times a 4096-token batch would be gigabytes of logits at once."""
    flat = feats.reshape(-1, feats.shape[-1])
    out = torch.cat([(chunk @ head.t()).argmax(-1) for chunk in flat.split(rows)])
    return out.view(feats.shape[:-1])


def _eval_now(state: dict) -> dict | None:
    """The history's evaluation of the draft as of this step, if it has one (an --eval-every step, an
    epoch's end and the run's end can coincide: the draft is evaluated once)."""
    last = next((h for h in reversed(state["history"]) if "eval" in h), None)
    return last if last is not None and last["step"] == state["step"] else None


def _record_eval(state: dict, ev: EvalResult, bar) -> None:
    state["history"].append({"step": state["step"], "epoch": state["epoch"], "train_s": state["train_s"],
                             "cpu_s": state.get("cpu_s", 0.0), "eval": asdict(ev)})
    bar.write(f"step {state['step']} (epoch {state['epoch']}, {state['train_s'] / 60:.0f} min): held-out top-1 "
              f"per step {' '.join(f'{x:.3f}' for x in ev.step_top1)}, accepted length {ev.accepted_length:.2f}")


@torch.no_grad()
def copy_block(blk, w: dict) -> None:
    """Load a target block (HF layout: q, k, v, o, gate, up, down, attn_norm, ffn_norm) into a draft block.

    WHY: the target's own last block already maps a residual stream to the next hidden state; the
    draft starts from that function instead of noise.  A block whose attention reads EAGLE-3's wide
    input ([norm(e); norm(g)]) takes the target's q/k/v on its g half; its e half stays random."""
    qkv = torch.from_numpy(np.concatenate([w["q"], w["k"], w["v"]]))
    gate_up = torch.from_numpy(np.concatenate([w["gate"], w["up"]]))
    h = qkv.shape[1]
    for name, have, want in (("qkv", blk.qkv.weight.shape[0], qkv.shape[0]), ("ffn", blk.down.weight.shape[1],
                                                                               w["down"].shape[1])):
        if have != want:
            raise HeteroSpecError(f"the target's block does not fit the draft's ({name}: {want} vs {have}); "
                                  "draft and target must share head counts and FFN size")
    blk.qkv.weight[:, -h:].copy_(qkv)
    blk.o.weight.copy_(torch.from_numpy(w["o"]))
    blk.gate_up.weight.copy_(gate_up)
    blk.down.weight.copy_(torch.from_numpy(w["down"]))
    blk.ffn_norm.weight.copy_(torch.from_numpy(w["ffn_norm"]))
    if blk.attn_norm is not None:
        blk.attn_norm.weight.copy_(torch.from_numpy(w["attn_norm"]))


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Row t of the result is row t+n of x (zeros / False past the end)."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def _use_bf16(precision: str, device: torch.device) -> bool:
    if precision not in ("auto", "bf16", "fp32"):
        raise HeteroSpecError(f"unknown precision {precision!r} (use auto, bf16 or fp32)")
    if precision == "auto":
        return device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())
    return precision == "bf16"


def _draft_config(cfg: TrainConfig, fp: TargetFingerprint, d2t: torch.Tensor) -> DraftConfig:
    try:
        return draft_config_for(fp, cfg.variant, n_blocks=cfg.n_blocks, taps=cfg.taps or None,
                                reduced_vocab=len(d2t) if len(d2t) < fp.n_vocab else 0)
    except ConfigError as exc:
        raise HeteroSpecError(str(exc)) from None


def _start_draft(cfg: TrainConfig, fp: TargetFingerprint) -> DraftModel:
    if cfg.init_from_target:
        raise HeteroSpecError("init_from and init_from_target both set the starting weights: choose one")
    return load_draft(cfg.init_from, fp)


def _adopt(model: DraftModel, start: DraftModel, name: str) -> None:
    """Copy ``start``'s weights into ``model``, refusing a file whose architecture the options change."""
    ours, theirs = asdict(model.cfg), asdict(start.cfg)
    diffs = [f"{k} {theirs[k]!r} (options: {ours[k]!r})" for k in ours
             if k not in ("fingerprint", "max_positions") and ours[k] != theirs[k]]
    if diffs:
        raise HeteroSpecError(f"cannot continue from {name}: its " + "; ".join(diffs))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in start.state_dict().items()},
                          strict=True)


def _prior_training(path: Path) -> dict:
    """The starting file's own training (steps, CPU seconds, and where it started from in turn)."""
    prior = json.loads(read_metadata(path).get(TRAINING_KEY, "{}"))
    keep = ("variant", "steps", "train_seconds", "train_cpu_seconds", "train_tokens", "init_from")
    return {"file": path.name, **{k: prior[k] for k in keep if k in prior}}


def _cpu_thread_s(state: dict) -> float:
    """CPU seconds per thread, summed step by step.  A checkpoint from before that sum was kept
    ran on one thread count throughout, so its CPU seconds divide by the current one."""
    if "cpu_thread_s" in state:
        return state["cpu_thread_s"]
    return state.get("cpu_s", 0.0) / max(1, torch.get_num_threads())


def _add_step_cpu(state: dict, cpu_s: float, threads: int) -> None:
    """Count one step's CPU seconds (all threads), and on the cpu budget's clock per thread of
    *this* step: a resume with another --threads continues the clock instead of rescaling every
    step already taken."""
    state["cpu_thread_s"] = _cpu_thread_s(state) + cpu_s / max(1, threads)
    state["cpu_s"] = state.get("cpu_s", 0.0) + cpu_s


def _spent(state: dict, cfg: TrainConfig) -> float:
    """Training time used so far, on the clock the budget counts (``TrainConfig.budget_clock``)."""
    if cfg.budget_clock == "cpu":
        return _cpu_thread_s(state)
    return state["train_s"]


def _warmup_cosine(warmup: int, total: int, time_budget_s: float):
    """lr factor: linear warm-up, then cosine decay to 10% over the run.  With a time budget the
    run's progress is the larger of steps done and budget spent, so the decay ends when the
    budget does instead of at a step count the budget never reaches."""
    warmup = max(1, warmup)

    def f(step: int, train_s: float) -> float:
        warm = (step + 1) / warmup
        if time_budget_s:  # a slow run may do few steps: warm-up ends by 5% of the budget at the latest
            warm = max(warm, train_s / (0.05 * time_budget_s))
        if warm < 1.0:
            return warm
        progress = (step - warmup) / max(1, total - warmup)
        if time_budget_s:
            progress = max(progress, train_s / time_budget_s)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def _feature_rms(seqs, taps: tuple[int, ...] = ()) -> torch.Tensor:
    """[n_in] per-channel RMS of what the draft reads (the final hidden state, or the taps side by side) over
    a sample.  Per channel, because the taps' channels span four orders of magnitude (massive activations)."""
    sample = [np.concatenate([s.extras[k][:64] for k in tap_keys(taps)], axis=1) if taps else s.hidden[:64]
              for s in seqs[:256]]
    rows = np.concatenate(sample).astype(np.float32)
    return torch.from_numpy(np.sqrt((rows**2).mean(axis=0)))


def tap_scale_for(rms: torch.Tensor) -> torch.Tensor:
    """1 / RMS per channel, rounded to a power of two (exact in bf16 and in any weight it folds into)."""
    return torch.exp2(-torch.round(torch.log2(rms.clamp_min(1e-3))))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _device(spec: str, local_rank: int) -> torch.device:
    """auto: this rank's GPU when torch sees one; a bare ``cuda`` under torchrun also means this rank's
    GPU (torch.device("cuda") would put every rank of the machine on GPU 0)."""
    if spec == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if spec in ("auto", "cuda"):
        return torch.device(f"cuda:{local_rank % max(1, torch.cuda.device_count())}")
    return torch.device(spec)


def _init_distributed() -> tuple[int, int, int, bool]:
    """(rank, world size, local rank, whether this call made the process group) from torchrun's
    environment.  A group the caller made already is reused and left to it (make-draft)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0, False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), world, local_rank, False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return torch.distributed.get_rank(), world, local_rank, True


def _rank_batches(batches: list, rank: int, world: int) -> list:
    """Every ``world``-th batch from ``rank``, the same number on every rank: a rank with one batch more
    would enter a gradient all-reduce that no other rank joins, and hang there."""
    n = len(batches) // world
    return batches[rank::world][:n]


def _agree(out_of_time: bool, stop_requested: bool, device: torch.device) -> tuple[bool, bool]:
    """Under DDP: (rank 0's out-of-time, any rank's stop request), the same on every rank.  Each rank's
    own clock differs a little, and a rank that stops alone leaves the others waiting in the next
    step's all-reduce."""
    flags = torch.tensor([float(out_of_time) if torch.distributed.get_rank() == 0 else 0.0, float(stop_requested)],
                         device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])


def _leave_group() -> None:
    """Every rank waits for rank 0's writes, collects the caller's dropped DDP wrapper, then destroys the group.

    WHY: a rank that destroyed the group while its DDP reducer still held it (freed later, by the
    interpreter's last garbage collection) aborted at exit now and then ("terminate called without an
    active exception"), failing a run whose draft was already written."""
    torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()


def _ddp(runner: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP over the unrolled forward.  The target's embedding and head are buffers of the draft (frozen,
    the same on every rank, the embedding hundreds of MB): DDP neither broadcasts them at the start nor
    before every forward (``broadcast_buffers=False``; the other buffers are computed alike on every rank)."""
    import inspect

    ddp = torch.nn.parallel.DistributedDataParallel
    frozen = [f"model.{name}" for name in ("embed", "head")]
    ddp._set_params_and_buffers_to_ignore_for_model(runner, frozen)
    # newer torch renames the option (and still syncs the buffers left at init, which is harmless here)
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp).parameters
               else {"broadcast_buffers": False})
    return ddp(runner, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)


class _Unrolled(torch.nn.Module):
    """Gives DDP a forward to hook: the unrolled multi-step pass."""

    def __init__(self, model: DraftModel, steps: int) -> None:
        super().__init__()
        self.model, self.steps = model, steps

    def forward(self, feats, next_tokens, valid, holes=None, queries=None, chains=None):
        return unrolled_forward(self.model, feats, next_tokens, valid, self.steps, holes, queries, chains)


def _save_checkpoint(path: Path, model, opt, state) -> None:
    with atomic_file.replacing(path) as tmp:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}},
                   tmp)


def _load_checkpoint(path: Path, model, opt) -> dict:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ck["model"], strict=False)
    opt.load_state_dict(ck["opt"])
    torch.set_rng_state(ck["rng"]["torch"])
    np.random.set_state(ck["rng"]["numpy"])
    random.setstate(ck["rng"]["python"])
    return ck["state"]


def _jsonable(d):
    return json.loads(json.dumps(d, default=str))


def _plot_history(history: list[dict], path: Path) -> None:
    """Training loss, train top-1, and the held-out curves: top-1 per unrolled step and the
    teacher-forced accepted length, against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval" in h]
    if not steps:
        return
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.5))
    ax[0].plot([h["step"] for h in steps], [h["loss"] for h in steps], lw=0.6)
    ax[0].set(xlabel="step", ylabel="training loss", yscale="log")
    ax[1].plot([h["step"] for h in steps], [h["acc"] for h in steps], lw=0.6, color="0.6", label="train top-1 (step 0)")
    for j in range(len(evals[0]["eval"].get("step_top1", [])) if evals else 0):
        ax[1].plot([h["step"] for h in evals], [h["eval"]["step_top1"][j] for h in evals], "o-", ms=3,
                   label=f"held-out top-1, step {j}")
    ax[1].set(xlabel="step", ylabel="accuracy vs the target's argmax")
    ax[1].legend(fontsize=7)
    if evals:
        ax[2].plot([h["step"] for h in evals], [h["eval"]["accepted_length"] for h in evals], "o-", ms=3)
    ax[2].set(xlabel="step", ylabel="held-out accepted length (teacher-forced)")
    fig.tight_layout()
    atomic_file.save_figure(fig, path, dpi=110)
    plt.close(fig)
