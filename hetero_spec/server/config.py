"""Frozen settings of one server: what the model is built from, and how requests are admitted.

Kept free of web-framework imports so the CLI can build it without the ``[server]`` extra.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DEFAULT_CACHE_RAM_MIB, DEFAULT_KV_TYPE, ConfigError, DenoiseConfig, DraftLen, TreeSpec

LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class EngineConfig:
    """The one ``HeteroSpec`` the server owns, and the drafting options every request inherits
    (the same target and draft options as ``hetero-spec run``; sampling is per request)."""

    model: Path
    draft: Path | None = None
    n_ctx: int = 4096
    threads: int = 0
    draft_device: str = "auto"
    draft_dtype: str = "auto"
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    kv_type: str = DEFAULT_KV_TYPE
    draft_len: DraftLen = "auto"
    tree: TreeSpec | None = None
    draft_p_min: float | None = None
    lookup: bool = True
    suffix: bool | None = None  # one slot: None as ``lookup``, False prompt lookup (the engine's slots copy by suffix)
    parallel: int = 1  # slots: > 1 decodes that many requests together in the batched engine
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB  # with slots: free slots' cells kept in host memory (0: off)

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ConfigError(f"--parallel must be >= 1, not {self.parallel}")
        if self.cache_ram_mib < 0:
            raise ConfigError(f"--cache-ram must be >= 0 MiB, not {self.cache_ram_mib}")
        if self.parallel > 1 and self.tree is not None:
            raise ConfigError("--tree drafts for one sequence at a time: the batched engine (--parallel > 1) verifies "
                              "chains; drop --tree, or serve with --parallel 1")
        if self.parallel > 1 and self.suffix is False:
            raise ConfigError("--no-suffix is for one sequence at a time: the batched engine (--parallel > 1) copies "
                              "from the suffix structure only; serve with --parallel 1, or --no-lookup for no copies")

    def generate_options(self) -> dict:
        """Keyword arguments of ``HeteroSpec.generate`` that come from the server, not the request."""
        # without a draft model, auto still drafts from the text itself (suffix structure, prompt lookup);
        # --no-draft arrives here as draft_len 0
        return dict(draft_len=self.draft_len, tree=self.tree,
                    draft_p_min=self.draft_p_min, lookup=self.lookup, suffix=self.suffix)


@dataclass(frozen=True)
class ServerConfig:
    """Network and admission settings; ``model_id`` is what ``/v1/models`` lists and requests name."""

    model_id: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 16  # requests waiting (the running one not counted); more get a 429
    queue_timeout: float = 300.0  # seconds a request may wait for the model before a 503
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ConfigError(f"max queue must be >= 0, not {self.max_queue}")
        if self.queue_timeout <= 0:
            raise ConfigError(f"queue timeout must be > 0 seconds, not {self.queue_timeout}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body must be at least 1024 bytes, not {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, not {self.port}")

    @property
    def loopback_only(self) -> bool:
        """True when only this machine can connect (the default); anything else deserves a warning."""
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
