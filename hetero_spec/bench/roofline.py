"""A roofline cost curve for a target we cannot measure here: a 7B Q4_0 model on an 8-core laptop.

One decode of n rows streams every weight once and does 2 x params FLOPs per row, so

    t(n) = max(weight bytes / memory bandwidth,  n x 2 x params / compute)

(attention over a short context adds about 2% of the weight traffic and is left out).  A draft
step is the same bound over the draft's weights.  The curve is flat until the compute time of
n rows overtakes the weight traffic, which is why verification is nearly free on a
memory-bound 7B and steep on this project's 135M target on 2 cores.

Figures for ``LAPTOP_7B_Q4_0`` (each an assumption, stated so it can be changed):

- weights: 3.8 GB streamed per decode: a LLaMA-2-7B Q4_0 GGUF is 3.83 GB (6.74e9 parameters at
  4.5 bits: 18 bytes per block of 32), less the token-embedding table a decode reads one row of;
- bandwidth: 64 GB/s sustained; dual-channel DDR5-5600 peaks at 2 x 8 B x 5.6e9 = 89.6 GB/s
  and sustains about 70% of it in streaming reads; so t(1) = 59 ms (17 tok/s);
- compute: 0.8 TFLOPS effective in llama.cpp's Q4_0 x Q8_0 matmuls on 8 AVX2+FMA cores.
  Peak fp32 FMA is 8 cores x 32 FLOP/cycle x ~3.5 GHz = 0.9 TFLOPS; llama.cpp reached 139
  tok/s prompt processing for LLaMA-3.1-8B Q4_0 on a 32-core AVX2 Ryzen 5975WX (ik_llama.cpp
  PR #54, 2024: 2.2 TFLOPS, 70 GFLOPS a core) and its x86 Q4_0 repacking since adds about a
  third, so 8 laptop cores give 0.5-0.9; we take 0.8;
- draft step: an EAGLE-style draft for a 4096-wide target (one decoder block of 202 M
  parameters, the 2d -> d fusion of 34 M, an 8192-row reduced head of 34 M) as the runtime's
  native step streams it on a CPU: the block and the fusion in int8, the head in int4 with a
  scale per row (``draft/native.py``; its best 16 rows rescored in float add 0.26 MB):
  0.25 GB per step, 4.0 ms at 64 GB/s (its 0.54 GFLOP take 0.7 ms).  A forward over n rows (a
  tree's depth) streams the same weights once, so it costs one step up to n = 5 rows.

Regenerate the shipped JSON after changing a figure:
``python -m hetero_spec.bench.roofline > hetero_spec/bench/data/curves/laptop-7b-q4_0.json``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..calibration import MAX_ROWS, CostCurve


@dataclass(frozen=True)
class Roofline:
    name: str
    weight_bytes: float  # bytes streamed per target decode
    params: float  # target parameters: 2 x params FLOPs per row
    bandwidth: float  # sustained memory bandwidth, bytes/s
    compute: float  # sustained matmul throughput, FLOP/s
    draft_bytes: float  # draft weights streamed per draft step
    draft_params: float

    def verify_ms(self, n: int) -> float:
        """t(n) in ms: the slower of streaming the weights once and computing n rows."""
        return 1e3 * max(self.weight_bytes / self.bandwidth, n * 2 * self.params / self.compute)

    def draft_step_ms(self) -> float:
        return self.draft_rows_ms(1)

    def draft_rows_ms(self, n: int) -> float:
        """One draft forward over n rows: the same bound over the draft's weights and n rows of FLOPs."""
        return 1e3 * max(self.draft_bytes / self.bandwidth, n * 2 * self.draft_params / self.compute)

    def curve(self, max_rows: int = MAX_ROWS) -> CostCurve:
        return CostCurve(
            verify_ms={n: round(self.verify_ms(n), 4) for n in range(1, max_rows + 1)},
            draft_step_ms=round(self.draft_step_ms(), 4),
            draft_rows_ms={n: round(self.draft_rows_ms(n), 4) for n in range(1, max_rows + 1)},
            machine=(f"roofline: {self.bandwidth / 1e9:.0f} GB/s, {self.compute / 1e12:.2f} TFLOPS "
                     "(8-core AVX2 laptop, DDR5; see hetero_spec/bench/roofline.py)"),
            model=(f"{self.name}: {self.weight_bytes / 1e9:.2f} GB weights, {self.params / 1e9:.2f} B params; "
                   f"int8 draft with an int4 head, {self.draft_bytes / 1e9:.2f} GB a step"),
        )


LAPTOP_7B_Q4_0 = Roofline(
    name="7B Q4_0 (LLaMA-2-7B class)", weight_bytes=3.8e9, params=6.74e9, bandwidth=64e9, compute=0.8e12,
    draft_bytes=(202e6 + 34e6) + 34e6 / 2 + 16 * 4096 * 4, draft_params=0.27e9,
)


if __name__ == "__main__":
    print(LAPTOP_7B_Q4_0.curve().to_json())
