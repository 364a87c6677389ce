"""Cost-equivalent targets: a small GGUF that costs per token what a model N times larger costs.

Only small GGUFs are available to benchmark on, while the machines this project is for
run 7B-13B targets whose single-row decode is far more expensive relative to a draft
step.  Appending decoder blocks whose attention-output and FFN-down projections are
zero makes each new block add exactly 0.0 to the residual stream, so every logit and
hidden state stays bit-identical to the base model; yet each block still streams its
weights, runs its matmuls and fills its KV cells.  The result is NOT a larger model:
it reproduces only the cost of one, and everything that reports on it says so (the
file carries ``hetero_spec.cost_equivalent.*`` metadata for that purpose).

All-zero bytes decode to 0.0 in every GGML type (F32/F16/BF16, Q4_0/Q4_1/Q5/Q8: the
block scale d and min m are zero; K-quants likewise), so zeroing needs no re-quantizing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import HeteroSpecError

META_SCALE = "hetero_spec.cost_equivalent.scale"
META_BASE = "hetero_spec.cost_equivalent.base"
META_EXTRA = "hetero_spec.cost_equivalent.extra_blocks"
ZEROED = ("attn_output", "ffn_down")  # the two projections that write into the residual stream
LABEL = "cost-equivalent target (base model plus zero-output blocks), NOT a real larger model"
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class CostEquivalentPlan:
    base_blocks: int
    extra_blocks: int
    base_bytes: int  # all tensor bytes of the base
    block_bytes: float  # mean bytes of one base block
    scale: float

    @property
    def out_bytes(self) -> float:
        return self.base_bytes + self.extra_blocks * self.block_bytes


def plan(reader, scale: float) -> CostEquivalentPlan:
    """Blocks to add so that the weights streamed per token grow about ``scale`` times."""
    if scale < 1:
        raise HeteroSpecError(f"--scale must be at least 1, not {scale}")
    arch = _field(reader, "general.architecture")
    n_blocks = int(_field(reader, f"{arch}.block_count"))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    in_blocks = sum(int(t.n_bytes) for t in reader.tensors if _BLOCK.match(t.name))
    if n_blocks < 1 or in_blocks == 0:
        raise HeteroSpecError("the base GGUF has no decoder blocks (blk.N.*) to copy")
    per_block = in_blocks / n_blocks
    extra = int(round((scale - 1.0) * total / per_block))
    return CostEquivalentPlan(n_blocks, extra, total, per_block, scale)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        raise HeteroSpecError(f"the GGUF has no {key} metadata")
    return f.contents()


def _check_zeroable(reader, n_blocks: int) -> None:
    names = {t.name for t in reader.tensors}
    for suffix in ZEROED:
        if f"blk.0.{suffix}.weight" not in names:
            raise HeteroSpecError(
                f"blk.0.{suffix}.weight not found: this architecture's blocks are not laid out like llama's"
            )
    if any(f"blk.0.{s}.bias" in names for s in ZEROED):
        raise HeteroSpecError("output projections with biases are not supported (the bias would reach the residual)")


def write_cost_equivalent(base: str | Path, out: str | Path, scale: float, progress=None) -> CostEquivalentPlan:
    """Write ``out``: base metadata and tensors byte for byte, plus zero-output copies of its blocks."""
    import gguf

    base, out = Path(base), Path(out)
    if base.resolve() == out.resolve():
        raise HeteroSpecError("OUT must differ from BASE")
    reader = gguf.GGUFReader(base)
    p = plan(reader, scale)
    _check_zeroable(reader, p.base_blocks)
    arch = _field(reader, "general.architecture")
    n_total = p.base_blocks + p.extra_blocks
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = n_total
        elif sub is not None and sub != gguf.GGUFValueType.STRING and field.name.startswith(f"{arch}.") \
                and len(value) == p.base_blocks:  # per-layer arrays (some archs): extend cyclically
            value = [value[i % p.base_blocks] for i in range(n_total)]
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    writer.add_key_value(META_SCALE, float(scale), gguf.GGUFValueType.FLOAT32)
    writer.add_key_value(META_BASE, base.name, gguf.GGUFValueType.STRING)
    writer.add_key_value(META_EXTRA, p.extra_blocks, gguf.GGUFValueType.UINT32)

    blocks: dict[int, list] = {}
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append((m.group(2), t))
    plan_tensors: list[tuple[str, np.ndarray, object, bool]] = [(t.name, t.data, t.tensor_type, False)
                                                               for t in reader.tensors]
    for j in range(p.extra_blocks):
        src = j % p.base_blocks
        for rest, t in blocks[src]:
            zero = rest.split(".")[0] in ZEROED
            plan_tensors.append((f"blk.{p.base_blocks + j}.{rest}", t.data, t.tensor_type, zero))
    for name, data, ttype, _ in plan_tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _, zero in plan_tensors:
        # data: the raw stored array (uint8 bytes for quantized types), written unchanged or as zeros
        writer.write_tensor_data(np.zeros_like(data) if zero else data, tensor_endianess=reader.endianess)
        if progress:
            progress(int(data.nbytes))
    writer.close()
    return p


def cost_equivalent_label(model_meta) -> str | None:
    """The report label for a target, from its metadata getter (``ModelHandle.meta``); None for a real model."""
    scale = model_meta(META_SCALE)
    if scale is None:
        return None
    return f"{LABEL}: scale {float(scale):g} of {model_meta(META_BASE)}"


def greedy_identity(base: str | Path, out: str | Path, prompts: list[str], max_new_tokens: int = 24,
                    n_threads: int = 0) -> list[dict]:
    """For each prompt: are the prompt's last-row logits bit-identical and the greedy tokens equal?"""
    from ..api import HeteroSpec

    results = []
    with HeteroSpec(base, n_ctx=512, threads=n_threads) as a, HeteroSpec(out, n_ctx=512, threads=n_threads) as b:
        for text in prompts:
            ids = a.target.tokenize(a.render([{"role": "user", "content": text}]), add_special=False)
            a.reset()
            b.reset()
            _, la = a.target.prefill(ids)
            _, lb = b.target.prefill(ids)
            logits_equal = bool(np.array_equal(la, lb))
            a.reset()
            b.reset()
            ta = a.generate(ids, max_new_tokens=max_new_tokens, draft_len=0).tokens
            tb = b.generate(ids, max_new_tokens=max_new_tokens, draft_len=0).tokens
            results.append({"prompt": text, "logits_equal": logits_equal, "tokens_equal": ta == tb,
                            "tokens": len(ta)})
    return results
