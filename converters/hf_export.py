"""The same feature export, hidden states computed by transformers from a Hugging Face checkpoint.

For users who have the fp16/bf16 checkpoint of their target (optional extra ``[hf]``).  The
GGUF still supplies the tokenizer, chat template, fingerprint and (with ``--regenerate``)
the answers, so the dataset lines up with the target that will verify the draft; only the
hidden states, top-k log-probs and block outputs come from the HF model.  transformers is
imported lazily, here only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from hetero_spec.errors import HeteroSpecError


class HFExtractor:
    """``run(ids, on_logits)`` -> (hidden ``[T, d] f32``, {i: block i output ``[T, d] f32``}), like LayerTapTarget."""

    def __init__(self, folder: Path, layers: tuple[int, ...], *, n_embd: int, n_vocab: int, threads: int = 0) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise HeteroSpecError("--hf-model needs transformers: pip install 'hetero-spec[hf]'") from None
        if not (Path(folder) / "config.json").is_file():
            raise HeteroSpecError(f"{folder} is not a Hugging Face checkpoint (no config.json)")
        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        try:
            self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        except Exception as exc:  # transformers raises many types for a bad checkpoint
            raise HeteroSpecError(f"transformers could not load {folder}: {exc}") from None
        cfg = self.model.config
        if cfg.hidden_size != n_embd or cfg.vocab_size < n_vocab:
            raise HeteroSpecError(f"{folder} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not match the "
                                  f"GGUF target (hidden {n_embd}, vocab {n_vocab})")
        blocks = self.model.model.layers
        bad = [i for i in layers if not 0 <= i < len(blocks)]
        if bad:
            raise HeteroSpecError(f"--layers {bad} out of range: the model has blocks 0..{len(blocks) - 1}")
        self.layers = layers
        self.n_vocab = n_vocab
        self._captured: dict[int, object] = {}
        self._hooks = [blocks[i].register_forward_hook(self._hook(i)) for i in layers]

    def _hook(self, i: int):
        def save(module, args, output) -> None:  # noqa: ARG001
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return save

    def run(self, ids: list[int], on_logits: Callable[[int, np.ndarray], None] | None = None
            ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        torch = self._torch
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0].float().numpy()  # after the final norm: the LM head's input
        if on_logits is not None:
            on_logits(0, out.logits[0, :, : self.n_vocab].float().numpy())
        layers = {i: self._captured[i].reshape(len(ids), -1).float().numpy() for i in self.layers}
        return hidden, layers

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

