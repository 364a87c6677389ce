#!/usr/bin/env bash
# Recipe for the shipped SmolLM2-135M drafts (darter and its eagle baseline), on a 2-core CPU.
# Same data and the same wall-clock budget for both; see drafts/README.md for what it produced.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,3p' "$0"; exit 0; }
MODEL="$(python scripts/default_model.py)"              # the all-Q4_0 requantization
DATA="${DATA:-data}"
BUDGET_MIN="${BUDGET_MIN:-60}"

# 1a. self-distilled features: ShareGPT first turns answered by the target itself (greedy).
hetero-spec export-features "$MODEL" "$DATA/feats_regen" --regenerate --limit 992 --seed 0 \
  --max-new-tokens 192 --n-seq 16 --max-len 1024 -t 1 --shard-mb 32
# 1b. plain ShareGPT conversations (all turns, the original answers), disjoint from 1a: prefill
#     only, so several times more tokens per minute; the target's own head still supplies p.
hetero-spec export-features "$MODEL" "$DATA/feats_plain" --seed 0 --offset 2000 --limit "${PLAIN_LIMIT:-1600}" \
  --max-len 1024 -t 2 --shard-mb 32

# 2. both drafts side by side, one thread each, the same time budget and data.
#    darter: 1 block (a CPU draft step is paid every drafted token), DGF, DarterSD gate and loss, 2 unrolled steps.
hetero-spec train "$DATA/feats_regen" "$DATA/feats_plain" --target "$MODEL" \
  --out drafts/smollm2-135m-darter.safetensors --variant darter --blocks 1 --unroll 2 \
  --time-budget "$BUDGET_MIN" --epochs 50 --threads 1 &
hetero-spec train "$DATA/feats_regen" "$DATA/feats_plain" --target "$MODEL" \
  --out drafts/smollm2-135m-eagle.safetensors --variant eagle --unroll 1 \
  --time-budget "$BUDGET_MIN" --epochs 50 --threads 1 &
wait
