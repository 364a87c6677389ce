#!/usr/bin/env bash
# Recipe for the shipped SmolLM2-135M drafts (darter and its eagle baseline), on a 2-core CPU.
# Same data and the same wall-clock budget for both; see drafts/README.md for what it produced.
set -euo pipefail
MODEL="$(python scripts/default_model.py)"              # the all-Q4_0 requantization
FEATS="${FEATS:-data/feats_smollm2_q4_0}"
BUDGET_MIN="${BUDGET_MIN:-45}"

# 1. self-distilled features: ShareGPT first turns answered by the target itself (greedy).
#    -t 1: on a loaded 2-core machine, 2 llama.cpp threads spin-wait and run 4-13x slower.
hetero-spec export-features "$MODEL" "$FEATS" --regenerate --limit "${LIMIT:-2000}" --seed 0 \
  --max-new-tokens 192 --n-seq 16 --max-len 1024 -t 1 --shard-mb 32

# 2. both drafts side by side, one thread each, the same time budget.
hetero-spec train "$FEATS" --target "$MODEL" --out drafts/smollm2-135m-darter.safetensors \
  --variant darter --blocks 2 --unroll 3 --time-budget "$BUDGET_MIN" --epochs 50 --threads 1 &
hetero-spec train "$FEATS" --target "$MODEL" --out drafts/smollm2-135m-eagle.safetensors \
  --variant eagle --unroll 1 --time-budget "$BUDGET_MIN" --epochs 50 --threads 1 &
wait
