"""Int8 weights for the CPU draft: the step is memory-bound, so bytes per token decide its cost.

Measured on this project's 2-core CPU, one thread, one token (median):

| weight [out x in] | fp32    | bf16    | int8 (fbgemm dynamic) |
|-------------------|---------|---------|-----------------------|
| 3072 x 576        | 136 us  | 143 us  | 40 us                 |
| 8192 x 576 (head) | 1400 us | 378 us  | 74 us                 |
| 49152 x 576       | 9981 us | 6639 us | 918 us                |

fbgemm's dynamic linear quantizes the activation row per call (asymmetric, u8) and runs an
int8 GEMM with per-output-channel weight scales; the draft only proposes, so its small
error changes acceptance at most, never the output.

**Two modes, chosen by measured error.**  Without VNNI (AVX2 or AVX-512 without
``vpdpbusd``), fbgemm multiplies u8 activations by s8 weights with ``vpmaddubsw``, which
adds adjacent pairs into a *saturating int16*: 2 x 255 x 127 overflows, and on such CPUs a
draft's outputs came out 11% off (0.45 on the fused features).  ``reduce_range`` quantizes
activations to 7 bits (2 x 127 x 127 fits), at a little precision.  CPU flags do not say
everything (a hypervisor may hide VNNI, fbgemm may pick another kernel), so the runner
measures both modes on real rows (the target's features of a fixed text) and keeps the
first whose layers stay within ``INT8_MAX_ERROR`` and whose proposals equal float's on
``INT8_MIN_AGREEMENT`` of the steps; ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` forces the saturating
kernels on any x86 CPU, which is how the tests cover the path a VNNI host never takes.

**The head rescores its best rows in float** (``RescoredInt8Head``).  On an AVX2-only EPYC the
shipped eagle draft's int8 proposals matched float's on 90% (8-bit) and 94% (7-bit) of the
calibration steps, so ``auto`` fell back to float32; most of the misses were near-ties flipped
by the int8 head alone.  Recomputing its top 8 rows exactly raised the agreement to 96-97%
(8-bit) and 96-100% (7-bit) on both shipped drafts, for about 20 us a step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

# Worst relative error ||y_q - y|| / ||y|| of any quantized matmul (fusion excluded, smoothed) on the
# calibration rows, one row at a time.  The shipped drafts measured 0.009 with 8-bit activations and
# 0.013 with 7-bit ones, and 0.024-0.025 with 8 bits on the saturating (non-VNNI) kernels.
INT8_MAX_ERROR = 0.02


def int8_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and "fbgemm" in torch.backends.quantized.supported_engines


def weight_int8_available() -> bool:
    """Whether torch has the weight-only int8 matmul (``aten._weight_int8pack_mm``, bf16 activations)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class WeightInt8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as per-channel int8 and x kept as bf16, never quantized.

    WHY: the fusion (and the taps' fc) read the target's raw features, whose outlier channels a
    quantized activation row cannot carry (fbgemm's dynamic int8 there cost 10-30 points of agreement
    with float); their weights are ordinary, though.  Weight-only int8 reads a quarter of float32's
    bytes and leaves the activations at bf16's relative precision (2^-8), whatever their range.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
        self.weight_q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
        self.scale = scale.to(torch.bfloat16)  # [out]
        self.bias = None if bias is None else bias.detach().float().cpu()  # [out]
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32."""
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.weight_q, self.scale)
        y = y.float().view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as per-channel int8, activations quantized on the fly
    to 8 bits, or to 7 with ``reduce_range`` (no int16 saturation on CPUs without VNNI).

    ``smooth`` [in] (SmoothQuant): y = (x / s)(W diag(s))^T, the same product with the input's
    outlier channels (a target feature reaches 47 where most channels stay under 3) moved
    into the weights, so one row's 256 activation levels are not spent on a few channels.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool = False,
                 smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        self.inv_smooth = None
        if smooth is not None:
            w = w * smooth.float()
            self.inv_smooth = (1.0 / smooth.float()).contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized-tensor constructors warn about a future removal
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float().cpu())
        self.out_features = w.shape[0]
        self.reduce_range = reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        return torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)


class RescoredInt8Head(nn.Module):
    """The draft's LM head in int8, with its ``rescore`` best rows recomputed exactly in float.

    WHY: the head's argmax *is* the proposal, and an int8 head flips near-ties: on the shipped
    eagle draft (AVX2-only EPYC, 7-bit activations) a plain int8 head alone cost 2-6 points of
    agreement with the float draft's proposals.  The true argmax is practically always among the
    int8 head's top 8, so recomputing those 8 rows in float (8 dot products) makes the argmax, and
    the ranking of the candidates a tree expands, those of a float head on the same feature.
    """

    def __init__(self, head: torch.Tensor, reduce_range: bool, smooth: torch.Tensor | None, rescore: int = 8) -> None:
        super().__init__()
        self.q = Int8Linear(head, None, reduce_range, smooth)
        self.weight = head.detach().float().cpu()  # [n_head, n_embd]
        self.rescore = min(rescore, self.weight.shape[0])

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        """feat [B, n_embd] float32 -> logits [B, n_head]: int8 everywhere, exact on the top rows."""
        logits = self.q(feat)
        idx = logits.topk(self.rescore, dim=-1).indices  # [B, r]
        exact = torch.einsum("bd,brd->br", feat.float(), self.weight[idx])
        return logits.scatter(-1, idx, exact.to(logits.dtype))

    def best_rows(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``best`` for a batch: feat [B, n_embd] -> (head rows [B], their exact logits [B])."""
        idx = self.q(feat).topk(self.rescore, dim=-1, sorted=False).indices  # [B, r]
        exact = torch.einsum("bd,brd->br", feat.float(), self.weight[idx])  # [B, r]
        score, j = exact.max(dim=-1)
        return idx.gather(1, j[:, None])[:, 0], score

    def best(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feat [1, n_embd] -> (head row [], its exact logit []): the greedy proposal alone.

        WHY: a chain step needs only the argmax, and the full-logits path (scatter the exact scores
        back, then an argmax over all rows) cost about a third of the head's time on top of its int8
        matmul.  The argmax among the exactly rescored best rows is what a float head would pick
        whenever its argmax is among them.  (``forward``'s full logits keep the other rows' int8 values,
        so in a rare near-tie its argmax can be a row ``best`` never picks: proposals only.)"""
        idx = self.q(feat)[0].topk(self.rescore, sorted=False).indices  # [r]
        exact = torch.mv(self.weight.index_select(0, idx), feat[0].float())  # [r]
        score, j = exact.max(dim=0)
        return idx.gather(0, j.view(1))[0], score


def smooth_scale(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-channel s_j = max|x_j|^a / max|W_j|^(1-a), a = 0.5."""
    w_max = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return (act_absmax.float().clamp_min(1e-5) ** alpha / w_max ** (1 - alpha)).clamp(1e-2, 1e2)


def quantize_linears(module: nn.Module, reduce_range: bool = False, smooth: dict[str, torch.Tensor] | None = None,
                     min_out: int = 2, prefix: str = "", skip: tuple[str, ...] = (),
                     weight_only: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear (with at least ``min_out`` outputs, outside the ``skip`` subtrees) in place;
    returns how many.  ``smooth``: per qualified layer name, the SmoothQuant scale of its input.  Layers in
    the ``weight_only`` subtrees get ``WeightInt8Linear`` (float where torch lacks its kernel) instead."""
    count = 0
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if full in skip:
            continue
        if full in weight_only and not weight_int8_available():
            continue
        if full in weight_only and isinstance(child, nn.Linear):
            setattr(module, name, WeightInt8Linear(child.weight, child.bias))
            count += 1
        elif full in weight_only:
            count += _weight_only(child)
        elif isinstance(child, nn.Linear) and child.out_features >= min_out:
            s = (smooth or {}).get(full)
            setattr(module, name, Int8Linear(child.weight, child.bias, reduce_range, s))
            count += 1
        else:
            count += quantize_linears(child, reduce_range, smooth, min_out, f"{full}.", skip, weight_only)
    return count


def _weight_only(module: nn.Module) -> int:
    """Every nn.Linear below ``module`` -> WeightInt8Linear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, WeightInt8Linear(child.weight, child.bias))
            count += 1
        else:
            count += _weight_only(child)
    return count


HEAD = "<head>"  # the key of the LM head among the smoothing scales
# The fusion (and the taps' fc) read the target's raw features, whose outlier channels (one reaches 47
# where most stay under 3) a row's 128 or 256 activation levels cannot carry: quantizing the fusion
# alone dropped the shipped draft's agreement with float to 0.70-0.90, every other layer together cost
# 1-3%.  Their activations stay in float: they get weight-only int8 (``WeightInt8Linear``, bf16
# activations), or float32 weights where torch lacks that kernel.
FLOAT_MODULES = ("fusion", "tap_fc")
INT8_MIN_AGREEMENT = 0.95  # share of calibration steps whose greedy proposal equals the float draft's


@dataclass(frozen=True)
class Int8Check:
    """What each int8 mode measured on one model: the worst per-layer relative error and the share of
    draft steps proposing what float proposes; ``mode`` is the first that passes both (None: neither)."""

    error_full: float  # 8-bit activations
    error_reduced: float  # 7-bit activations (reduce_range)
    agreement_full: float
    agreement_reduced: float

    @property
    def mode(self) -> str | None:
        if self.error_full <= INT8_MAX_ERROR and self.agreement_full >= INT8_MIN_AGREEMENT:
            return "int8"
        if self.error_reduced <= INT8_MAX_ERROR and self.agreement_reduced >= INT8_MIN_AGREEMENT:
            return "int8-reduced"
        return None


@dataclass(frozen=True)
class Int8Calibration:
    """Per-layer SmoothQuant scales (HEAD for the head) and, when measured, the check of both modes."""

    smooth: dict[str, torch.Tensor]
    check: Int8Check | None = None


@torch.no_grad()
def calibrate_int8(model: nn.Module, probe: Callable[[], torch.Tensor], head: torch.Tensor
                   ) -> tuple[dict[str, torch.Tensor], float, float]:
    """Run ``probe()`` (a float forward of ``model`` over real rows, returning the features the head
    reads) once, capturing the input of every layer that int8 would replace.  Returns each layer's
    SmoothQuant scale (HEAD for the head) and the worst relative error of any of them, run one row at
    a time as a draft step runs (fbgemm's many-row kernels accumulate differently and do not saturate
    where the one-row kernel does), with 8- and with 7-bit activations."""
    names = {m: n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.out_features >= 2 and not n.startswith(FLOAT_MODULES)}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs.__setitem__(names[mod], args[0].detach().float()))
             for m in names]
    try:
        feats = probe().float()
    finally:
        for h in hooks:
            h.remove()
    layers = {n: (m.weight.float(), None if m.bias is None else m.bias.float()) for m, n in names.items() if n in inputs}
    layers[HEAD], inputs[HEAD] = (head.float(), None), feats
    xs = {n: inputs[n].reshape(-1, inputs[n].shape[-1]) for n in layers}
    smooth = {n: smooth_scale(xs[n].abs().amax(dim=0), w) for n, (w, _) in layers.items()}

    def worst(reduce_range: bool) -> float:
        errs = []
        for n, (w, b) in layers.items():
            ref = torch.nn.functional.linear(xs[n], w, b)
            q = Int8Linear(w, b, reduce_range, smooth[n])
            got = torch.cat([q(row) for row in xs[n].split(1)])
            errs.append(float((got - ref).norm() / ref.norm().clamp_min(1e-12)))
        return max(errs)

    return smooth, worst(False), worst(True)
