"""A small self-distilled feature dataset made with the runtime's own target, for training tests.

Each sequence is a chat prompt plus the target's greedy answer; hidden states come from
one prefill of the whole sequence, as the exporter produces them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hetero_spec.chat_template import render_chat
from hetero_spec.features import FeatureSequence, Manifest, shard_name, write_manifest, write_shard
from hetero_spec.spec.orchestrator import generate_tokens
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


def build_features(model_path: Path, out: Path, prompts: list[str], *, max_new_tokens: int = 48,
                   per_shard: int = 4) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with LlamaTarget(model_path, TargetOptions(n_ctx=2048)) as t:
        seqs = []
        for p in prompts:
            text = render_chat(t.chat_template, [{"role": "user", "content": p}], bos_token=t.bos_token,
                               eos_token=t.eos_token)
            prompt = t.tokenize(text, add_special=False)
            t.reset()
            t.set_embeddings(False)
            answer = [x for s in generate_tokens(t, None, prompt, max_new_tokens=max_new_tokens, draft_len=0)
                      for x in s.tokens]
            ids = prompt + answer
            t.reset()
            t.set_embeddings(True)
            hidden, _ = t.prefill(ids)
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[len(prompt):] = 1
            seqs.append(FeatureSequence(np.array(ids, np.int32), hidden.astype(np.float16), mask))
        manifest = Manifest(fingerprint=t.fingerprint, template=t.chat_template, source={"kind": "test"})
    for i in range(0, len(seqs), per_shard):
        manifest.shards.append(write_shard(out / shard_name(i // per_shard), seqs[i : i + per_shard]))
    write_manifest(out, manifest)
    return out
