"""Teacher-forced against measured acceptance, on the target's own greedy answers to the bench prompts.

For each prompt, hetero-spec generates 128 tokens with a fixed chain of k drafts (greedy: the text is
the target's plain output), recording every round.  Then the trainer's teacher-forced estimate is
computed on that very text, with the draft in float32 through ``train.unroll`` (what ``evaluate``
runs): at every answer position, and at exactly the positions where the measured rounds started.

The three columns separate the causes of a gap:
  measured           the runtime: the draft's dtype (int8 on a CPU), its KV cache and catch-up;
  TF at rounds       the same chain starts, teacher-forced in float32: numerics alone differ;
  TF all positions   the trainer's held-out estimate restricted to this text: which positions
                     the rounds happen to start at (after a rejection, mostly harder ones).

Teacher forcing scores the rows the runner scores: the draft's head plus, for a reduced head, the
target's rows of the tokens so far (context rows); the trainer's held-out figures score the head alone.
``--also-rows head,full`` adds "TF all" with the draft's own rows alone and with every target row (what
a full head would reach), on the same text.

    python scripts/compare_acceptance.py MODEL DRAFT --n-prompts 20 -k 4 --draft-dtype auto -t 2
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from hetero_spec.api import HeteroSpec
from hetero_spec.bench.prompts import DATASETS, load_dataset
from hetero_spec.config import DRAFT_DTYPES
from hetero_spec.train.unroll import unrolled_forward


ROW_SETS = ("context", "head", "full")


def head_rows(model, ids: np.ndarray, which: str = "context") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows scored for a chain starting at each row s. "context", as the runner does: the draft's own
    rows plus the target's rows of every token up to x_{s+1} (draft/context_head.py); "head": the draft's
    rows alone (the trainer's held-out figures); "full": every target row (an upper bound for widening
    the head).  Returns (rows [n_vocab, n_embd], allowed [T, n_vocab] bool), or (the draft's head, None)
    where only the draft's own rows count."""
    if model.target_head is None or which == "head":
        return model.head, None
    if which == "full":
        return model.target_head, torch.ones(len(ids), model.target_head.shape[0], dtype=torch.bool)
    n_vocab = model.target_head.shape[0]
    first = np.full(n_vocab, len(ids) + 1)
    np.minimum.at(first, ids, np.arange(len(ids)))  # first position of each token in the text
    own = np.zeros(n_vocab, dtype=bool)
    own[model.d2t.numpy()] = True
    allowed = own[None, :] | (first[None, :] <= np.arange(len(ids))[:, None] + 1)
    return model.target_head, torch.from_numpy(allowed)


def teacher_forced(hs: HeteroSpec, model, ids: list[int], k: int, rows: str = "context") -> np.ndarray:
    """[len(ids), k+1]: for chain start s (row s = f_s with x_{s+1}), whether step j's argmax is x_{s+j+2},
    and in the last column the accepted length (leading matches, capped at the tokens that exist)."""
    hs.target.reset()
    feats, _ = hs.target.prefill(ids)
    hs.target.reset()
    T = len(ids)
    x = torch.from_numpy(np.asarray(feats, dtype=np.float32))[None]
    nxt = torch.tensor(ids[1:] + ids[-1:])[None]
    with torch.no_grad():
        steps = unrolled_forward(model, x, nxt, torch.ones(1, T, dtype=torch.bool), k)
    out = np.zeros((T, k + 1), dtype=np.int64)
    ids_arr = np.asarray(ids)
    head, allowed = head_rows(model, ids_arr, rows)
    for j, st in enumerate(steps):
        logits = st.features[0] @ head.t()
        if allowed is None:
            pred = model.d2t[logits.argmax(-1)].numpy()
        else:
            pred = logits.masked_fill_(~allowed, float("-inf")).argmax(-1).numpy()
        s = np.arange(T)
        ok = s + j + 2 < T
        out[ok, j] = pred[ok] == ids_arr[s[ok] + j + 2]
    run = np.ones(T, dtype=bool)
    for j in range(k):
        run &= out[:, j].astype(bool)
        out[:, k] += run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--n-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--also-rows", default="", help="comma-separated from head,full: TF all with those rows too")
    a = ap.parse_args()
    also = [r for r in a.also_rows.split(",") if r]
    if any(r not in ROW_SETS[1:] for r in also):
        ap.error(f"--also-rows takes {', '.join(ROW_SETS[1:])}")
    report = {}
    with HeteroSpec(a.model, a.draft, n_ctx=4096, threads=a.threads, draft_device="cpu", draft_dtype=a.draft_dtype) as hs:
        model = hs.draft.model if hs.draft.weights.startswith("float32") else None
        if model is None:  # the runner's copy is quantized: teacher-force a float32 copy of the file
            from hetero_spec.api import load_runner

            model = load_runner(hs.target, a.draft, device="cpu", dtype="float32", denoise=hs.draft.denoise).model
        print(f"draft runs as {hs.draft.weights}")
        for name in a.datasets.split(","):
            meas_first, meas_len, tf_first, tf_len, all_first, all_len = [], [], [], [], [], []
            also_len = {rows: [] for rows in also}
            for prompt in load_dataset(name, a.n_prompts).prompts:
                msgs = [{"role": "user", "content": prompt}]
                hs.reset()
                out = hs.chat(msgs, max_new_tokens=a.max_new_tokens, draft_len=a.k)
                p_ids = hs.target.tokenize(hs.render(msgs), add_special=False)
                ids = p_ids + out.tokens
                tf = teacher_forced(hs, model, ids, a.k)
                pos = len(p_ids)  # position of the token the prefill emitted
                for r in out.stats.rounds:
                    if r.drafted:
                        s = pos - 1  # the round's first draft predicts x_{pos+1} from row pos-1
                        meas_first.append(r.accepted >= 1)
                        meas_len.append(r.accepted + 1)
                        tf_first.append(bool(tf[s, 0]))
                        tf_len.append(min(int(tf[s, a.k]), r.drafted) + 1)
                    pos += r.emitted
                answer = range(len(p_ids) - 1, len(ids) - 2)
                all_first += [bool(tf[s, 0]) for s in answer]
                all_len += [int(tf[s, a.k]) + 1 for s in answer]
                for rows in also:
                    other = teacher_forced(hs, model, ids, a.k, rows)
                    also_len[rows] += [int(other[s, a.k]) + 1 for s in answer]
            report[name] = dict(rounds=len(meas_len), measured_first=float(np.mean(meas_first)),
                                tf_rounds_first=float(np.mean(tf_first)), tf_all_first=float(np.mean(all_first)),
                                measured_len=float(np.mean(meas_len)), tf_rounds_len=float(np.mean(tf_len)),
                                tf_all_len=float(np.mean(all_len)),
                                **{f"tf_all_len_{rows}": float(np.mean(v)) for rows, v in also_len.items()})
            r = report[name]
            print(f"{name:10s} first-token acceptance: measured {r['measured_first']:.3f}, TF at rounds "
                  f"{r['tf_rounds_first']:.3f}, TF all {r['tf_all_first']:.3f} | accepted length (k={a.k}): "
                  f"measured {r['measured_len']:.2f}, TF at rounds {r['tf_rounds_len']:.2f}, TF all "
                  f"{r['tf_all_len']:.2f}" + "".join(f", TF all with {rows} rows {np.mean(v):.2f}"
                                                     for rows, v in also_len.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
