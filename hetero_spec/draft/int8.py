"""Int8 weights for the CPU draft: the step is memory-bound, so bytes per token decide its cost.

Measured on this project's 2-core CPU, one thread, one token (median):

| weight [out x in] | fp32    | bf16    | int8 (fbgemm dynamic) |
|-------------------|---------|---------|-----------------------|
| 3072 x 576        | 136 us  | 143 us  | 40 us                 |
| 8192 x 576 (head) | 1400 us | 378 us  | 74 us                 |
| 49152 x 576       | 9981 us | 6639 us | 918 us                |

fbgemm's dynamic linear quantizes the activation row per call and runs an int8 GEMM
with per-output-channel weight scales; the draft only proposes, so its small error
changes acceptance at most, never the output.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn


def int8_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as per-channel int8, activations quantized on the fly."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized-tensor constructors warn about a future removal
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float().cpu())
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed)


def quantize_linears(module: nn.Module, min_out: int = 2) -> int:
    """Replace every nn.Linear (with at least ``min_out`` outputs) in place; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.out_features >= min_out:
            setattr(module, name, Int8Linear(child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child, min_out)
    return count
