"""Frozen configuration records shared by the target, the draft and the round loop.

Configs are plain data: no globals, no defaults hidden in constructors.  A draft file
carries its ``DraftConfig`` as JSON so that loading it needs no other file.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Union

from .errors import HeteroSpecError
from .inputs import whole



def usable_cpu_set() -> set[int]:
    """The logical CPUs this process may run on: its affinity mask (every CPU where there is none)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many logical CPUs this process may run on: the most ``-t`` a command accepts.  The default thread
    count is smaller where cores have SMT siblings or a cgroup quota applies
    (``target.llama_target.default_threads``)."""
    return max(1, len(usable_cpu_set()))


# the most -t a command accepts: threads past the CPUs wait for one, and llama.cpp's spinning workers then
# stall each other (1,000 threads on 2 CPUs ran a minute without a token)
MAX_THREADS = usable_cpus()


MIN_CTX = 16  # the smallest context the API and every --ctx take


def check_threads(threads: Any) -> int:
    """llama.cpp threads as the API takes them: 0 (the default count) up to ``MAX_THREADS``, as ``-t`` is."""
    if not whole(threads) or not 0 <= threads <= MAX_THREADS:
        raise ConfigError(f"threads must be a whole number from 0 (the default) to {MAX_THREADS}, the CPUs this "
                          f"process may use, not {threads!r}")
    return int(threads)


class ConfigError(HeteroSpecError, ValueError):
    """A configuration value a user supplied is invalid (rendered as a one-line error); a HeteroSpecError, so
    that an app's ``except HeteroSpecError`` catches every mistake in its input."""


@dataclass(frozen=True)
class TargetFingerprint:
    """What a draft must agree with to be used on a target.

    The tokenizer hash covers every token's text, so two GGUFs of the same model in
    different quantizations share a fingerprint while a different tokenizer does not.
    """

    architecture: str
    n_embd: int
    n_vocab: int
    tokenizer_sha256: str

    def mismatches(self, other: "TargetFingerprint") -> list[str]:
        return [
            f"{f.name}: draft has {getattr(other, f.name)!r}, target has {getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class DraftConfig:
    """Architecture of a draft model; serialised into the safetensors metadata."""

    n_embd: int  # the target's feature size (input f_t and predicted f_{t+1})
    n_vocab: int  # the target's vocabulary
    hidden_size: int = 576
    n_blocks: int = 1  # m decoder blocks (Dovetail: deeper helps more than wider)
    n_heads: int = 9
    n_kv_heads: int = 3
    ffn_size: int = 1536
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    fusion: str = "dgf"  # "dgf" (Dovetail) | "fc" (EAGLE) | "eagle3" (EAGLE-3's decoder input)
    gate: str = "darter"  # "darter" (importance gate) | "none"
    # Target blocks whose *input* the draft reads, fused by one linear layer (EAGLE-3; llama.cpp's
    # extract_layers).  Empty: the target's final-norm hidden state f_t (EAGLE-1/2).
    taps: tuple[int, ...] = ()
    reduced_vocab: int = 0  # 0 = full head; else number of target ids kept (mapping in the file)
    max_positions: int = 8192
    fingerprint: TargetFingerprint | None = None
    # Shapes of imported public heads (converters/draft_import.py); the defaults are hetero-spec's own
    # drafts, and ``to_json`` leaves default values out so existing draft files read as before.
    final_norm: bool = True  # False: the last block's output goes to the head unnormed (EAGLE-1/2)
    first_attn_norm: bool = True  # False: block 0's q/k/v read the fused x unnormed (EAGLE-1/2's layer 0)
    own_head: bool = False  # True: the file stores its own head rows (``own_head``), not the target's
    own_embed: bool = False  # True: the file stores its own token embedding (``own_embed``)
    # 0: hidden_size / n_heads.  Else the attention head size of an imported head whose heads are not a
    # split of its width (Qwen3-4B's EAGLE-3 heads: 32 heads of 128 over a width of 2,560).
    head_size: int = 0
    # Llama 3's RoPE frequency scaling (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), as the public Llama 3.x EAGLE-3 heads were trained with; () none.
    rope_scaling: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "taps", tuple(int(i) for i in self.taps))
        object.__setattr__(self, "rope_scaling", tuple(float(v) for v in self.rope_scaling))
        if self.fusion not in ("dgf", "fc", "eagle3"):
            raise ConfigError(f"fusion must be 'dgf', 'fc' or 'eagle3', not {self.fusion!r}")
        if self.fusion == "eagle3" and not self.first_attn_norm:
            raise ConfigError("first_attn_norm applies to dgf/fc fusion: eagle3's first block reads its own norms")
        if self.fusion == "eagle3" and self.feature_size != self.hidden_size:
            raise ConfigError("eagle3 fusion keeps g as the residual stream: it needs taps or hidden_size == n_embd")
        if len(set(self.taps)) != len(self.taps) or any(i < 0 for i in self.taps):
            raise ConfigError(f"taps must be distinct block indices, not {list(self.taps)}")
        if self.gate not in ("darter", "none"):
            raise ConfigError(f"gate must be 'darter' or 'none', not {self.gate!r}")
        if (not self.head_size and self.hidden_size % self.n_heads) or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} must divide into {self.n_heads} heads "
                f"and heads into {self.n_kv_heads} kv heads"
            )
        if self.head_dim % 2 or self.head_dim < 2:
            raise ConfigError("head size must be even for RoPE")
        if self.rope_scaling:
            if len(self.rope_scaling) != 4:
                raise ConfigError("rope_scaling is (factor, low_freq_factor, high_freq_factor, "
                                  f"original_max_position_embeddings), not {list(self.rope_scaling)}")
            factor, low, high, original = self.rope_scaling
            if factor <= 0 or original <= 0 or not 0 < low < high:
                raise ConfigError(f"rope_scaling {list(self.rope_scaling)} needs factor > 0 and 0 < low < high")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.n_heads

    @property
    def feature_size(self) -> int:
        """Width of g, the fusion's feature input: hidden_size with taps (after their fc), else n_embd."""
        return self.hidden_size if self.taps else self.n_embd

    @property
    def input_size(self) -> int:
        """Width of the rows the draft reads from the target per position."""
        return len(self.taps) * self.n_embd if self.taps else self.n_embd

    def to_json(self) -> str:
        data = asdict(self)
        for name, default in _IMPORT_FLAG_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DraftConfig":
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"draft config has unknown keys {sorted(unknown)}")
        fp = data.pop("fingerprint", None)
        return cls(**data, fingerprint=TargetFingerprint(**fp) if fp else None)


# DraftConfig fields written only when they differ from these (drafts made before them stay readable by
# older hetero-spec versions, whose from_json refuses unknown keys).
_IMPORT_FLAG_DEFAULTS: dict[str, Any] = {"final_norm": True, "first_attn_norm": True, "own_head": False,
                                         "own_embed": False, "head_size": 0, "rope_scaling": ()}


# Named draft shapes; the CLI's --preset and the trainer pick from here.
DRAFT_PRESETS: dict[str, dict[str, Any]] = {
    "eagle": dict(fusion="fc", gate="none", n_blocks=1),
    "eagle3": dict(fusion="eagle3", gate="none", n_blocks=1),
    "dovetail": dict(fusion="dgf", gate="none", n_blocks=2),
    "darter": dict(fusion="dgf", gate="darter", n_blocks=2),
}


def draft_config_for(fingerprint: TargetFingerprint, preset: str = "darter", **overrides: Any) -> DraftConfig:
    """A draft shaped for a target: its feature size and vocabulary, Llama-like head and FFN
    proportions, and the preset's fusion/gate/depth; ``None`` overrides are ignored."""
    if preset not in DRAFT_PRESETS:
        raise ConfigError(f"unknown draft preset {preset!r} (use {', '.join(DRAFT_PRESETS)})")
    n = fingerprint.n_embd
    heads = next(h for h in (9, 8, 12, 16, 6, 4, 3, 2, 1) if n % h == 0 and (n // h) % 2 == 0)
    base = DraftConfig(
        n_embd=n,
        n_vocab=fingerprint.n_vocab,
        hidden_size=n,
        n_heads=heads,
        n_kv_heads=next(kv for kv in (3, 4, 2, 1) if heads % kv == 0),
        ffn_size=((int(n * 8 / 3) + 63) // 64) * 64,
        fingerprint=fingerprint,
        **DRAFT_PRESETS[preset],
    )
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


# --draft-dtype values (draft/runner.py).  auto: bf16 on CUDA; on a CPU int8 weights when an int8 mode is
# measured accurate there, else the fastest float.  int8 takes whichever int8 mode is accurate;
# int8-full and int8-reduced force 8- or 7-bit activations (draft/int8.py), for tests and comparisons.
DRAFT_DTYPES = ("auto", "int8", "int8-full", "int8-reduced", "float32", "bfloat16", "float16")

# KV cell types of the target's llama.cpp contexts.  q8_0 is the default because quantized cells
# keep verification bit-identical to plain decoding at any length (see TargetOptions.kv_type).
KV_TYPES = ("q8_0", "f16", "q4_0", "bf16", "f32")
DEFAULT_KV_TYPE = "q8_0"
# host memory for the cells of past prompts in the batched engine (engine/prompt_cache.py): about 87,000 tokens of
# SmolLM2's q8_0 cells, 15,000 of Llama 3 8B's (llama-server's --cache-ram defaults to 8 GiB)
DEFAULT_CACHE_RAM_MIB = 1024


@dataclass(frozen=True)
class DenoiseConfig:
    """DarterSD Boolean-mask denoising of the draft's attention at inference."""

    threshold: float = 0.0  # keys with gate s_j below this are dropped; 0 disables
    recent_window: int = 32  # the last W keys are always kept

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise ConfigError(f"denoise threshold must be in [0, 1), not {self.threshold}")
        if self.recent_window < 1:
            raise ConfigError("denoise recent window must be at least 1")


@dataclass(frozen=True)
class SamplingConfig:
    """Token selection, with llama.cpp's definitions and defaults (see ``spec/sampling.py``).

    temperature 0 means greedy (exact equality with plain decoding); otherwise the output
    follows the target's distribution after top-k, top-p, min-p and temperature, and
    ``seed`` makes a run reproducible from the same cache state (a new ``HeteroSpec``, or
    after ``reset()``).  A call that reuses the cached prompt prefix of an earlier one
    feeds the draft only the new rows, and a torch forward over one row and over many
    round differently; the draft's q, and so which drafts are accepted, can then change,
    while the output still follows the target's distribution.
    """

    temperature: float = 0.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, numbers.Real) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, not {self.temperature!r}")
        if not whole(self.seed):
            raise ConfigError(f"seed must be a whole number, not {self.seed!r}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, not {self.seed} (the command line's and the server's -1 pick a "
                              "fresh one)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], not {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min-p must be in [0, 1), not {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# Deep and narrow by default: on a CPU target verification cost grows with every token
# (Dovetail), so a dozen tokens in a few branches beat EAGLE's 60-token trees.
MAX_TREE_TOKENS = 31  # + the root row = 32, the batch-invariant micro-batch


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2-style dynamic tree: ``top_k`` children per expansion and frontier width,
    at most ``total_tokens`` drafted nodes over at most ``depth`` levels."""

    total_tokens: int = 12
    depth: int = 6
    top_k: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.total_tokens <= MAX_TREE_TOKENS:
            raise ConfigError(f"tree tokens must be in 1..{MAX_TREE_TOKENS}, not {self.total_tokens}")
        if not 1 <= self.depth <= MAX_TREE_TOKENS:
            raise ConfigError(f"tree depth must be in 1..{MAX_TREE_TOKENS}, not {self.depth}")
        if not 1 <= self.top_k <= 8:
            raise ConfigError(f"tree top-k must be in 1..8, not {self.top_k}")


DraftLen = Union[int, str]  # k, or "auto"
AUTO_P_MIN = 0.1  # auto sizing's default draft-p-min


def parse_draft_len(value: "int | str") -> DraftLen:
    """``auto`` or an int in 0..32 (the CLI passes strings)."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"draft length must be 'auto' or an integer, not {value!r}") from None
    if not whole(value):
        raise ConfigError(f"draft length must be 'auto' or an integer, not {value!r}")
    if not 0 <= int(value) <= 32:
        raise ConfigError(f"draft length must be in 0..32, not {value}")
    return int(value)


@dataclass(frozen=True)
class SpecConfig:
    """One generation request."""

    max_new_tokens: int = 256
    draft_len: DraftLen = 3  # k draft tokens per round; 0 = plain decoding; "auto" = chosen per round
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    tree: TreeSpec | None = None  # None = chain drafting
    # Stop drafting when the draft's best probability at the frontier falls below this
    # (llama.cpp's draft-p-min).  None: AUTO_P_MIN with draft_len "auto", else off.
    draft_p_min: float | None = None
    # With draft_len "auto": also draft by copying (the suffix structure, or prompt lookup) when that pays.
    lookup: bool = True
    # With draft_len "auto": False leaves the draft model out, so auto drafts from the copy sources alone
    # (prompt lookup, or the suffix structure), as without a draft file: lookup-only, for comparison.
    # HeteroSpec.generate refuses it with a fixed draft_len (a fixed chain is the draft model's).
    draft_model: bool = True

    def __post_init__(self) -> None:
        if not whole(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a whole number >= 1, not {self.max_new_tokens!r}")
        object.__setattr__(self, "draft_len", parse_draft_len(self.draft_len))
        if self.draft_p_min is not None and not 0.0 <= self.draft_p_min < 1.0:
            raise ConfigError(f"draft p-min must be in [0, 1), not {self.draft_p_min}")

    @property
    def p_min(self) -> float:
        if self.draft_p_min is not None:
            return self.draft_p_min
        return AUTO_P_MIN if self.draft_len == "auto" else 0.0

    def with_(self, **changes: Any) -> "SpecConfig":
        return replace(self, **changes)
