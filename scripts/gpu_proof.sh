#!/usr/bin/env bash
# The GPU measurement of the heterogeneous design (the draft on CUDA, the target on the CPU) as one
# prepared bundle, for a GPU machine lent for a few minutes at a time, with no network, no
# llama-cpp-python and no gguf, where files arrive in parts of at most 64 MiB.
#
#   bash scripts/gpu_proof.sh pack [DIR]          # here: build the parts under DIR (default dist/gpu-proof)
#   OUT=/some/dir bash gpu_proof.sh run           # there, in the folder holding the parts: install, measure
#   bash scripts/gpu_proof.sh cpu-check OUT_DIR   # here: run's steps with --draft-device cpu, fewer prompts
#
# pack: a portable llama-cpp-python wheel (generic x86-64 with AVX2, FMA and F16C; no native flags, no
#   AVX-512, no AMX), the wheels such a machine lacks, the project as a wheel plus its scripts and
#   draft, and the default target GGUF, cut into parts of at most 64 MiB; DIR/SEND_ORDER.txt lists
#   the parts in the order to send them (this script first, then the checksums, the bundle, the model).
# run: checks and joins the parts, installs into a venv that sees the machine's own torch (GPU_PROOF_PYTHON:
#   the interpreter that has it, default python3), then, within
#   GPU_PROOF_BUDGET_S seconds (default 460: the 8 minutes from the first part sent, less the copies):
#   1. the CPU's verification curve at a few thread counts (hetero-spec calibrate --quick);
#   2. the draft step on CUDA with its hand-off (scripts/bench_draft_step.py --device cuda);
#   3. raw, auto, chain k = 1..5 and the tree, --draft-device cuda, on the four shipped sets, 10 prompts each;
#   4. the same on a x10 cost-equivalent target made there (fewer prompts and methods: each token costs 10x);
#   writing $OUT/bench.json (step 3), $OUT/bench-x10.json, $OUT/speedup.png, curves, draft_step.json, log.txt.
# cpu-check: steps 1-4 here, on the current environment, with --draft-device cpu and
#   GPU_PROOF_PROMPTS (default 2) prompts of GPU_PROOF_TOKENS (default 32) tokens; writes OUT_DIR/bench.json.
#   tests/integration/test_gpu_proof.py runs it, so the steps cannot rot unseen.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_VERSION=0.3.36   # must equal hetero_spec/target/_ffi.py PINNED_VERSION
PART_BYTES=64M         # the most one file may weigh on the way
DRAFT_REL=drafts/smollm2-135m-darter.safetensors
# Generic x86-64 with AVX2/FMA/F16C: runs on any CPU of the last decade; AVX-512 and AMX off (an AMX path
# crashed on a VM whose CPU advertised tiles it could not use).
PORTABLE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DGGML_OPENMP=ON \
-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# What the GPU machine lacks besides llama-cpp-python (torch, transformers and numpy bring the rest).
PURE_WHEELS=(gguf click diskcache cycler pyparsing python-dateutil six packaging)
# matplotlib (the PNGs) and its compiled dependencies, for the Python versions such a machine may run
PLATFORM_WHEELS=(matplotlib contourpy kiwisolver pillow fonttools)
PYTHONS=(3.10 3.11 3.12)

log() { echo "[gpu_proof $(date +%H:%M:%S)] $*" >&2; }

# ------------------------------------------------------------------------------------------------ pack
pack() {
  local dir="${1:-$ROOT/dist/gpu-proof}"
  local stage="$dir/stage" wheels="$dir/stage/wheels"
  mkdir -p "$wheels"
  if ! compgen -G "$wheels/llama_cpp_python-$LLAMA_VERSION-*.whl" >/dev/null; then
    log "building the portable llama-cpp-python $LLAMA_VERSION wheel (5-9 minutes on 2 cores)"
    CMAKE_ARGS="$PORTABLE_CMAKE_ARGS" FORCE_CMAKE=1 python -m pip wheel --no-deps --no-cache-dir \
      --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -w "$wheels"
  fi
  log "downloading the other wheels"
  python -m pip download -q --no-deps -d "$wheels" "${PURE_WHEELS[@]}"
  for py in "${PYTHONS[@]}"; do
    python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$wheels" "${PLATFORM_WHEELS[@]}" pyyaml
  done
  log "the project"
  rm -f "$wheels"/hetero_spec-*.whl
  python -m pip wheel -q --no-deps "$ROOT" -w "$wheels"
  rm -rf "$stage/repo" && mkdir -p "$stage/repo/drafts"
  cp -r "$ROOT/scripts" "$stage/repo/" && cp "$ROOT/$DRAFT_REL" "$stage/repo/drafts/"
  find "$stage/repo" -name __pycache__ -prune -exec rm -rf {} +
  log "cutting the parts"
  local model
  model="$(cd "$ROOT" && python scripts/default_model.py)"
  rm -f "$dir"/bundle.tar.part-* "$dir"/model.gguf.part-*
  tar -C "$stage" -cf - wheels repo | split -b "$PART_BYTES" -d -a 2 - "$dir/bundle.tar.part-"
  split -b "$PART_BYTES" -d -a 2 "$model" "$dir/model.gguf.part-"
  cp "$ROOT/scripts/gpu_proof.sh" "$dir/gpu_proof.sh"
  (cd "$dir" && sha256sum bundle.tar.part-* model.gguf.part-* > SHA256SUMS)
  sha256sum < "$model" | awk '{print $1"  model.gguf"}' > "$dir/MODEL.sha256"  # of the joined file
  {
    echo "# send in this order (each file at most 64 MiB), then: OUT=\$PWD/out bash gpu_proof.sh run"
    echo gpu_proof.sh
    echo SHA256SUMS
    echo MODEL.sha256
    (cd "$dir" && ls bundle.tar.part-* model.gguf.part-*)
  } > "$dir/SEND_ORDER.txt"
  log "wrote $(($(wc -l < "$dir/SEND_ORDER.txt") - 1)) files under $dir: $(du -sh "$dir" --exclude=stage | cut -f1)"
  cat "$dir/SEND_ORDER.txt"
}

# ------------------------------------------------------------------------------------------------ steps
# remaining SECONDS_LEFT: seconds until the deadline (at least 1)
left() { local s=$((DEADLINE - $(date +%s))); echo $((s > 1 ? s : 1)); }

# steps DEVICE MODEL DRAFT OUT: what run measures, parametrised by the GPU_PROOF_* settings
steps() {
  local device="$1" model="$2" draft="$3" out="$4" scripts="$5"
  local prompts="${GPU_PROOF_PROMPTS:-10}" tokens="${GPU_PROOF_TOKENS:-128}" threads="${GPU_PROOF_THREADS:-0}"
  local curve_threads="${GPU_PROOF_CURVE_THREADS:-4 8 16}" x10_prompts="${GPU_PROOF_X10_PROMPTS:-3}"
  local x10_scale="${GPU_PROOF_X10_SCALE:-10}" sets="${GPU_PROOF_SETS:-mt_bench,humaneval,gsm8k,alpaca}"
  local methods="${GPU_PROOF_METHODS:-raw,auto,chain-k1,chain-k2,chain-k3,chain-k4,chain-k5,tree}"
  local x10_methods="${GPU_PROOF_X10_METHODS:-raw,auto,chain-k3,tree}" rounds="${GPU_PROOF_DRAFT_ROUNDS:-200}"
  local curve_timings="--quick"  # 3 timings a width; GPU_PROOF_CURVE_REPEATS sets another count
  [[ -n "${GPU_PROOF_CURVE_REPEATS:-}" ]] && curve_timings="--repeats $GPU_PROOF_CURVE_REPEATS"
  mkdir -p "$out"
  for t in $curve_threads; do
    log "1. verification curve, $t threads"
    timeout "$(left)" hetero-spec calibrate "$model" "$draft" -t "$t" $curve_timings --draft-device "$device" \
      --out "$out/curve-t$t.json" > "$out/curve-t$t.txt" || log "curve at $t threads did not finish"
  done
  log "2. the draft step on $device"
  timeout "$(left)" python "$scripts/bench_draft_step.py" "$model" "$draft" --device "$device" --rounds "$rounds" \
    --json "$out/draft_step.json" > "$out/draft_step.txt" || log "draft step did not finish"
  log "3. bench: $methods on $sets, $prompts prompts, $tokens tokens, --draft-device $device"
  timeout "$(left)" hetero-spec bench "$model" "$draft" --datasets "$sets" --methods "$methods" \
    --n-prompts "$prompts" --max-new-tokens "$tokens" -t "$threads" --draft-device "$device" \
    --project laptop-7b-q4_0 --out "$out/bench" > "$out/bench.txt" || log "bench did not finish"
  [[ -f "$out/bench/bench.json" ]] && cp "$out/bench/bench.json" "$out/bench.json"
  [[ -f "$out/bench/speedup.png" ]] && cp "$out/bench/speedup.png" "$out/speedup.png"
  if [[ "$x10_prompts" -gt 0 ]]; then
    log "4. a x$x10_scale cost-equivalent target, then $x10_methods on it, $x10_prompts prompts a set"
    local x10="$WORK/x$x10_scale.gguf"
    [[ -f "$x10" ]] || timeout "$(left)" python "$scripts/make_cost_equivalent_target.py" "$model" "$x10" \
      --scale "$x10_scale" --check-tokens 8 > "$out/x10-make.txt" 2>&1 || log "x10 target not made"
    if [[ -f "$x10" ]]; then
      timeout "$(left)" hetero-spec bench "$x10" "$draft" --datasets "$sets" --methods "$x10_methods" \
        --n-prompts "$x10_prompts" --max-new-tokens "$tokens" -t "$threads" --draft-device "$device" \
        --project laptop-7b-q4_0 --out "$out/bench-x10" > "$out/bench-x10.txt" || log "x10 bench did not finish"
      [[ -f "$out/bench-x10/bench.json" ]] && cp "$out/bench-x10/bench.json" "$out/bench-x10.json"
    fi
  fi
  log "done: $(ls "$out" | tr '\n' ' ')"
}

# ------------------------------------------------------------------------------------------------ run
run() {
  : "${OUT:?set OUT to the folder whose files come back}"
  local here="${GPU_PROOF_DIR:-$PWD}"
  DEADLINE=$(($(date +%s) + ${GPU_PROOF_BUDGET_S:-460}))
  WORK="${GPU_PROOF_WORK:-$here/work}"
  mkdir -p "$OUT" "$WORK"
  exec > >(tee -a "$OUT/log.txt") 2>&1
  log "checking and joining the parts in $here"
  (cd "$here" && sha256sum -c --quiet SHA256SUMS)
  cat "$here"/bundle.tar.part-* | tar -x -C "$WORK"
  cat "$here"/model.gguf.part-* > "$WORK/model.gguf"
  (cd "$WORK" && sha256sum -c --quiet "$here/MODEL.sha256")
  log "installing (no network; the machine's torch, transformers and numpy are kept)"
  "${GPU_PROOF_PYTHON:-python3}" -m venv --system-site-packages "$WORK/venv"  # the interpreter that has torch
  # shellcheck disable=SC1091
  . "$WORK/venv/bin/activate"
  python -m pip install -q --no-index --find-links "$WORK/wheels" "$WORK"/wheels/hetero_spec-*.whl
  python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>/dev/null || true
  lscpu > "$OUT/cpu.txt" 2>/dev/null || true
  cd "$WORK/repo"
  steps cuda "$WORK/model.gguf" "$WORK/repo/$DRAFT_REL" "$OUT" "$WORK/repo/scripts"
}

# ------------------------------------------------------------------------------------------------ cpu-check
cpu_check() {
  local out="${1:?usage: gpu_proof.sh cpu-check OUT_DIR}"
  out="$(mkdir -p "$out" && cd "$out" && pwd)"
  DEADLINE=$(($(date +%s) + ${GPU_PROOF_BUDGET_S:-3600}))
  WORK="$out/work"
  mkdir -p "$WORK"
  local model
  model="$(cd "$ROOT" && python scripts/default_model.py)"
  cd "$ROOT"
  GPU_PROOF_PROMPTS="${GPU_PROOF_PROMPTS:-2}" GPU_PROOF_TOKENS="${GPU_PROOF_TOKENS:-32}" \
  GPU_PROOF_CURVE_THREADS="${GPU_PROOF_CURVE_THREADS:-2}" GPU_PROOF_X10_PROMPTS="${GPU_PROOF_X10_PROMPTS:-1}" \
  GPU_PROOF_THREADS="${GPU_PROOF_THREADS:-2}" GPU_PROOF_DRAFT_ROUNDS="${GPU_PROOF_DRAFT_ROUNDS:-30}" \
    steps cpu "$model" "$ROOT/$DRAFT_REL" "$out" "$ROOT/scripts"
  rm -rf "$WORK"
  [[ -f "$out/bench.json" ]] || { log "no bench.json written"; exit 1; }
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) run ;;
  cpu-check) shift; cpu_check "$@" ;;
  -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
  *) sed -n '2,24p' "$0"; exit 2 ;;
esac
