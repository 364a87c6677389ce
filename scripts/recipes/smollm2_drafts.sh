#!/usr/bin/env bash
# One resumable command that rebuilds the shipped SmolLM2-135M drafts from nothing:
#   1. the self-distilled corpus (the target's own greedy answers to ShareGPT, EAGLE-3 taps stored),
#   2. the DarterSD/DGF draft with taps (the product) and the EAGLE-3 baseline, trained side by side on
#      the same data and the same wall-clock budget, one thread each,
#   3. the drafts copied to drafts/.
# Every step resumes where it stopped: rerun this script after an interruption (or on a new machine
# with DATA restored).  Budgets are minutes of training time per draft, summed over resumed runs.
#
#   DATA=/work/data BUDGET_MIN=300 bash scripts/recipes/smollm2_drafts.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$(python scripts/default_model.py)"             # the all-Q4_0 requantization
DATA="${DATA:-data}"
BUDGET_MIN="${BUDGET_MIN:-300}"
THREADS="${THREADS:-1}"                                 # corpus threads (2 when nothing else runs)
TAPS="2,15,27"                                          # low, middle, high: EAGLE-3's choice for 30 blocks

# 1. corpus: ~9.5k ShareGPT conversations, first turn and (after the target's own answer) second turn,
#    greedy, <= 256 new tokens a turn, decontaminated against the four bench sets.  ~2.3M generated tokens.
hetero-spec generate-corpus "$MODEL" "$DATA/corpus" --limit 9500 --seed 0 --n-seq 16 --taps "$TAPS" \
  --chunk 256 -t "$THREADS"

# 2. both drafts, the same data and budget, one thread each.  --resume continues from OUT.train/
#    (the held-out split is fixed by each sequence's hash, so a corpus that grew meanwhile is safe).
common=(--target "$MODEL" --taps "$TAPS" --blocks 1 --unroll 3 --max-len 2048 --epochs 100 --threads 1
        --eval-every 500 --checkpoint-every 100 --time-budget "$BUDGET_MIN" --resume)
hetero-spec train "$DATA/corpus/features" --out "$DATA/drafts/smollm2-135m-darter.safetensors" \
  --variant darter "${common[@]}" &
hetero-spec train "$DATA/corpus/features" --out "$DATA/drafts/smollm2-135m-eagle3.safetensors" \
  --variant eagle3 --loss-weights '{"logit": 0, "feature": 0, "gate": 0, "token_weighting": false}' \
  "${common[@]}" &
wait

# 3. ship
cp "$DATA/drafts/smollm2-135m-darter.safetensors" "$DATA/drafts/smollm2-135m-eagle3.safetensors" drafts/
cp "$DATA/drafts/smollm2-135m-darter.train/training.png" drafts/smollm2-135m-darter.training.png
cp "$DATA/drafts/smollm2-135m-eagle3.train/training.png" drafts/smollm2-135m-eagle3.training.png
