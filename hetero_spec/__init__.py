"""hetero-spec: a GGUF target on the CPU (llama.cpp) verifying a small PyTorch draft.

Public API: ``HeteroSpec`` (generate / chat), ``BatchGenerator`` (many prompts on the batched engine), their
results, the config records and errors.
"""
from .api import Completion, HeteroSpec, TextStream
from .batch import BatchCompletion, BatchGenerator
from .config import DenoiseConfig, DraftConfig, SpecConfig
from .errors import ContextFull, DraftError, HeteroSpecError, TargetError
from .records import Round, RunStats

__all__ = [
    "HeteroSpec", "Completion", "TextStream", "BatchGenerator", "BatchCompletion", "DenoiseConfig", "DraftConfig", "SpecConfig",
    "HeteroSpecError", "TargetError", "ContextFull", "DraftError", "Round", "RunStats",
]
