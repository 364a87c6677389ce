#!/usr/bin/env bash
# The benchmarks behind docs/bench.md's comparison with llama.cpp's own speculative decoding, one
# after another (never two llama.cpp jobs at once on 2 cores): the shipped darter draft and its
# EAGLE-3 export, on SmolLM2 all-Q4_0 and on its x10 cost-equivalent target.  Greedy, 128 new
# tokens, 2 threads, every output compared with raw.  Needs scripts/build_llama_cpp.sh first.
#
#   OUT=bench-out N=20 bash scripts/recipes/bench_vs_llama_cpp.sh [q4|x10 ...]
# N_E3 (default N): prompts per set for the EAGLE-3 runs, where only the comparison is wanted.
set -euo pipefail
[[ "${1:-}" == -h || "${1:-}" == --help ]] && { sed -n '2,8p' "$0"; exit 0; }
cd "$(dirname "$0")/../.."
MODEL="$(python scripts/default_model.py)"
OUT="${OUT:-bench-vs-llama-cpp}"
N="${N:-20}"
N_E3="${N_E3:-$N}"
mkdir -p "$OUT"
X10="$OUT/x10.gguf"
E3="$OUT/smollm2-135m-eagle3.gguf"
[[ -f "$E3" ]] || hetero-spec export-draft drafts/smollm2-135m-eagle3.safetensors --target "$MODEL" --format gguf "$E3"

bench() {  # NAME TARGET DRAFT METHODS PROMPTS
  [[ -f "$OUT/$1/bench.json" ]] && { echo "$1: done already"; return; }
  hetero-spec bench "$2" "$3" --methods "$4" --n-prompts "$5" -t 2 --k 3 --eagle3-gguf "$E3" \
    --project laptop-7b-q4_0 --out "$OUT/$1"
}
sets=("$@")
[[ ${#sets[@]} -gt 0 ]] || sets=(q4 x10)
for t in "${sets[@]}"; do
  case "$t" in
    q4)  bench q4_darter "$MODEL" drafts/smollm2-135m-darter.safetensors raw,auto,llama.cpp-ngram "$N"
         bench q4_eagle3 "$MODEL" drafts/smollm2-135m-eagle3.safetensors raw,llama.cpp-eagle3,auto "$N_E3" ;;
    x10) [[ -f "$X10" ]] || python scripts/make_cost_equivalent_target.py "$MODEL" "$X10" --scale 10
         bench x10_darter "$X10" drafts/smollm2-135m-darter.safetensors raw,auto,llama.cpp-ngram "$N"
         bench x10_eagle3 "$X10" drafts/smollm2-135m-eagle3.safetensors raw,llama.cpp-eagle3,auto "$N_E3" ;;
    *)   echo "unknown target set '$t' (q4 or x10)" >&2; exit 2 ;;
  esac
done
