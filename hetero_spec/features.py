"""On-disk feature datasets: what converters/ writes and train/ reads.

A dataset is a folder with ``manifest.json`` and shards ``shard-00000.safetensors`` ...
Each shard holds whole sequences, concatenated:

| tensor          | dtype            | shape        | meaning                                         |
|-----------------|------------------|--------------|-------------------------------------------------|
| input_ids       | int32            | [N]          | token ids x_0..x_{T-1} of every sequence        |
| hidden          | float16 (or f32) | [N, n_embd]  | the target's final-norm hidden state f_t        |
| loss_mask       | uint8            | [N]          | 1 where x_t is an assistant token to learn      |
| seq_starts      | int64            | [S + 1]      | offsets of the sequences in the rows above      |
| topk_ids        | int32, optional  | [N, K]       | the target's top-K next-token ids at t          |
| topk_logprobs   | float16, optional| [N, K]       | their log-probabilities                         |
| layer_<i>       | float16, optional| [N, n_embd]  | hidden state after block i (export --layers)    |
| tap_<i>         | float16, optional| [N, n_embd]  | the input of block i (EAGLE-3 fusion; corpus)   |

Shards are written to a temporary name and renamed, so a shard that exists is complete;
an interrupted export keeps every finished shard and resumes after them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from . import atomic_file
from .config import TargetFingerprint
from .errors import HeteroSpecError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class FeatureError(HeteroSpecError):
    pass


@dataclass
class FeatureSequence:
    input_ids: np.ndarray  # [T] int32
    hidden: np.ndarray  # [T, n_embd] float16
    loss_mask: np.ndarray  # [T] uint8
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # [T, ...] per optional tensor

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ShardInfo:
    file: str
    n_sequences: int
    n_tokens: int
    n_loss_tokens: int


@dataclass
class Manifest:
    fingerprint: TargetFingerprint
    dtype: str = "float16"
    template: str | None = None
    source: dict = field(default_factory=dict)  # path, sha256, format, selection (limit/offset/seed)
    options: dict = field(default_factory=dict)  # regenerate, topk, layers, max_len, ...
    shards: list[ShardInfo] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    format: int = FORMAT_VERSION

    @property
    def n_sequences(self) -> int:
        return sum(s.n_sequences for s in self.shards)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    def to_json(self) -> str:
        d = asdict(self)
        d.update(n_sequences=self.n_sequences, n_tokens=self.n_tokens)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        d.pop("n_sequences", None)
        d.pop("n_tokens", None)
        d["fingerprint"] = TargetFingerprint(**d["fingerprint"])
        d["shards"] = [ShardInfo(**s) for s in d.get("shards", [])]
        return cls(**d)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_manifest(folder: str | Path) -> Manifest:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FeatureError(f"{folder} is not a feature dataset (no {MANIFEST})")
    try:
        m = Manifest.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise FeatureError(f"{path} is unreadable: {exc}") from None
    if m.format != FORMAT_VERSION:
        raise FeatureError(f"{path} has format {m.format}; this version reads {FORMAT_VERSION}")
    return m


def write_manifest(folder: str | Path, manifest: Manifest) -> None:
    atomic_file.write_text(Path(folder) / MANIFEST, manifest.to_json())


def write_shard(path: str | Path, sequences: list[FeatureSequence], metadata: dict[str, str] | None = None) -> ShardInfo:
    """Concatenate sequences into one safetensors shard, atomically."""
    from safetensors.numpy import save_file

    if not sequences:
        raise FeatureError("a shard needs at least one sequence")
    path = Path(path)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    tensors = {
        "input_ids": np.concatenate([s.input_ids for s in sequences]).astype(np.int32),
        "hidden": np.concatenate([s.hidden for s in sequences]),
        "loss_mask": np.concatenate([s.loss_mask for s in sequences]).astype(np.uint8),
        "seq_starts": np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
    }
    for key in sequences[0].extras:
        tensors[key] = np.concatenate([s.extras[key] for s in sequences])
    with atomic_file.replacing(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata)
    return ShardInfo(path.name, len(sequences), int(lengths.sum()), int(tensors["loss_mask"].sum()))


_NP_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": None, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def _map_shard(path: Path, keys: set[str] | None) -> dict[str, np.ndarray]:
    """Read-only memory maps of a shard's tensors (``keys`` only, when given).

    WHY not ``safetensors.numpy.load_file``: it copies every tensor into memory, and a corpus with
    EAGLE-3 taps is tens of GB; mapped, the page cache holds what training touches and two trainers
    share it.  The format is 8 bytes of header length, a JSON header, then the raw tensors."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__" or (keys is not None and key not in keys):
            continue
        dtype = _NP_DTYPES.get(info["dtype"])
        if dtype is None:
            raise FeatureError(f"{path}: tensor {key} has dtype {info['dtype']}, which this reader does not map")
        a, b = info["data_offsets"]
        shape = tuple(info["shape"])
        out[key] = (np.memmap(path, dtype=dtype, mode="r", offset=base + a, shape=shape) if b > a
                    else np.zeros(shape, dtype=dtype))
    return out


def read_shard(path: str | Path, *, mmap: bool = False, keys: set[str] | None = None) -> list[FeatureSequence]:
    """The sequences of one shard; ``mmap`` maps the tensors instead of reading them, and ``keys`` limits
    the optional tensors to those named (input_ids, hidden, loss_mask and seq_starts always come)."""
    from safetensors.numpy import load_file

    wanted = None if keys is None else set(keys) | {"input_ids", "hidden", "loss_mask", "seq_starts"}
    try:
        t = _map_shard(Path(path), wanted) if mmap else load_file(str(path))
    except FeatureError:
        raise
    except Exception as exc:  # safetensors raises several types on a damaged file
        raise FeatureError(f"{path} is unreadable: {exc}") from None
    if wanted is not None:
        t = {k: v for k, v in t.items() if k in wanted}
    starts = t.pop("seq_starts")
    ids, hidden, mask = t.pop("input_ids"), t.pop("hidden"), t.pop("loss_mask")
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        out.append(FeatureSequence(ids[a:b], hidden[a:b], mask[a:b], {k: v[a:b] for k, v in t.items()}))
    return out


def iter_sequences(folder: str | Path, *, mmap: bool = False, keys: set[str] | None = None) -> Iterator[FeatureSequence]:
    folder = Path(folder)
    for shard in read_manifest(folder).shards:
        yield from read_shard(folder / shard.file, mmap=mmap, keys=keys)
