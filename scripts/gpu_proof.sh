#!/usr/bin/env bash
# The GPU measurement of the heterogeneous design (the draft on CUDA, the target on the CPU) as one
# prepared bundle, for a GPU machine lent for a few minutes at a time, with no network, no
# llama-cpp-python and no gguf, where what one call carries (this checkout included) is at most 64 MiB.
#
#   bash scripts/gpu_proof.sh pack [DIR]          # here: cut the parts into DIR/call-NN (default dist/gpu-proof)
#   GPU_PROOF_DIR=DIR OUT=/some/dir bash scripts/gpu_proof.sh run   # there, in a checkout: install, measure
#   bash scripts/gpu_proof.sh cpu-check OUT_DIR   # here: run's steps with --draft-device cpu, fewer prompts
#
# pack: a portable llama-cpp-python wheel (generic x86-64 with AVX2, FMA and F16C; no native flags, no
#   AVX-512, no AMX), the pure wheels such a machine lacks, the project as a wheel, and the default
#   target GGUF, as one stream cut into parts that each fit one call beside the checkout (which travels
#   with every call: its tracked and untracked-not-ignored files); then matplotlib's wheels for
#   GPU_PROOF_PYTHON_VERSION (default 3.12) in parts of their own, needed only where matplotlib is missing
#   (GPU_PROOF_PLOT_WHEELS=0 leaves them out).  Each part goes in its own folder DIR/call-NN, to be carried
#   by one call; DIR/SEND_ORDER.txt says which, and the command of the last.  GPU_PROOF_WHEELS_FROM=WDIR
#   takes every wheel from WDIR instead of building and downloading them; GPU_PROOF_MODEL another GGUF.
#   (slim-wheel WHEEL: what pack does to the llama-cpp-python wheel it builds.)
# run: checks and joins the parts found under GPU_PROOF_DIR, installs them into a folder on PYTHONPATH beside
#   the machine's own torch (GPU_PROOF_PYTHON: the interpreter that has it, default python3), then, within
#   GPU_PROOF_BUDGET_S seconds (default 460: the 8 minutes from the first part sent, less the copies):
#   1. the CPU's verification curve at a few thread counts (hetero-spec calibrate --quick);
#   2. the draft step on CUDA with its hand-off (scripts/bench_draft_step.py --device cuda);
#   3. raw, auto, chain k = 1..5 and the tree, --draft-device cuda, on the four shipped sets, 10 prompts each;
#   4. the same on a x10 cost-equivalent target made there (fewer prompts and methods: each token costs 10x);
#   writing $OUT/bench.json (step 3), bench-x10.json, draft_step.json, speedup.png and log.txt, and the rest
#   (curves, each step's output) in $OUT/results.tar.gz: the device tool brings back at most 8 files.
#   The scripts and the draft come from the checkout this script is in.  GPU_PROOF_DEVICE=cpu rehearses it
#   all with the draft on the CPU, where no GPU is.
# cpu-check: steps 1-4 here, on the current environment, with --draft-device cpu and
#   GPU_PROOF_PROMPTS (default 2) prompts of GPU_PROOF_TOKENS (default 32) tokens; writes OUT_DIR/bench.json.
#   tests/integration/test_gpu_proof.py runs it, so the steps cannot rot unseen; it also packs a stand-in
#   model and joins it again (unpack DIR WORK, run's first step), so the parts cannot either.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA_VERSION=0.3.36   # must equal hetero_spec/target/_ffi.py PINNED_VERSION
CALL_BYTES="${GPU_PROOF_CALL_BYTES:-67108864}"  # what one call carries, the checkout included: 64 MiB
MARGIN_BYTES=1048576   # for SEND_ORDER.txt, the checksums and rounding
DRAFT_REL=drafts/smollm2-135m-darter.safetensors
# Generic x86-64 with AVX2/FMA/F16C: runs on any CPU of the last decade; AVX-512 and AMX off (an AMX path
# crashed on a VM whose CPU advertised tiles it could not use).
PORTABLE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DGGML_OPENMP=ON \
-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# What the GPU machine lacks besides llama-cpp-python and matplotlib (torch, transformers and numpy bring the
# rest: jinja2 with torch; safetensors, tqdm and pyyaml, which gguf needs, with transformers).
# GPU_PROOF_PURE_WHEELS replaces the list.
read -r -a PURE_WHEELS <<< "${GPU_PROOF_PURE_WHEELS-gguf click diskcache joblib}"
# matplotlib (the PNGs) and its compiled dependencies, for the Python of the GPU machine
PLATFORM_WHEELS=(matplotlib contourpy kiwisolver pillow fonttools cycler pyparsing python-dateutil six packaging)

PY=python  # the interpreter the steps run under (run: GPU_PROOF_PYTHON, the one that holds the machine's torch)

log() { echo "[gpu_proof $(date +%H:%M:%S)] $*" >&2; }
die() { log "$*"; exit 1; }
usage() { awk 'NR > 1 && /^set -euo/ {exit} NR > 1' "$0"; }

# bytes of the checkout that travel with every call: tracked files and untracked ones git does not ignore
travelling_bytes() {
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null) \
    | awk '{s += $1} END {print s + 0}'
}

# cut STREAM_FILE into parts of PART bytes named NAME.part-NN, each in its own DIR/call-NN folder (from NEXT)
cut_into_calls() {
  local file="$1" name="$2" part="$3" dir="$4" tmp="$4/cut"
  rm -rf "$tmp" && mkdir -p "$tmp"
  split -b "$part" -d -a 2 "$file" "$tmp/$name.part-"
  for f in "$tmp"/*; do
    NEXT=$((NEXT + 1))
    local call; call="$(printf 'call-%02d' "$NEXT")"
    mkdir -p "$dir/$call" && mv "$f" "$dir/$call/"
  done
  rmdir "$tmp"
}

# slim_wheel WHEEL: llama-cpp-python's wheel without what the runtime never loads, three quarters of its bytes:
# zip cannot hold a symlink, so each library is there three times (libX.so, the soname libX.so.N, and
# libX.so.N.M.P), and again under lib/ beside the headers, outside the package.  ctypes opens libX.so and
# the libraries find each other by soname (RUNPATH $ORIGIN), so llama_cpp/ keeps those two names.
slim_wheel() {
  python - "$1" <<'PY'
import base64, hashlib, re, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    files = [(i.filename, z.read(i), i.external_attr) for i in z.infolist() if not i.is_dir()]
keep = [(n, b, a) for n, b, a in files
        if not n.startswith(("lib/", "include/")) and not re.search(r"\.so\.\d+\.\d+", n)]
record = next(n for n, _, _ in keep if n.endswith(".dist-info/RECORD"))
lines = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
         for n, b, _ in keep if n != record] + [f"{record},,"]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for n, b, a in keep:
        info = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr, info.compress_type = a, zipfile.ZIP_DEFLATED
        z.writestr(info, "\n".join(lines) + "\n" if n == record else b)
PY
}

# ------------------------------------------------------------------------------------------------ pack
pack() {
  local dir="${1:-$ROOT/dist/gpu-proof}"
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  local stage="$dir/stage" wheels="$dir/stage/wheels" plots="$dir/plots/plot-wheels"
  local travel part
  travel="$(travelling_bytes)"
  part="${GPU_PROOF_PART_BYTES:-$((CALL_BYTES - travel - MARGIN_BYTES))}"
  ((part >= 1048576)) || die "the checkout alone carries $((travel / 1048576)) MiB of $((CALL_BYTES / 1048576)): no part fits beside it"
  mkdir -p "$wheels"
  if [[ -n "${GPU_PROOF_WHEELS_FROM:-}" ]]; then  # every wheel made before, elsewhere
    rm -f "$wheels"/*.whl && cp "$GPU_PROOF_WHEELS_FROM"/*.whl "$wheels/"
  else
    if ! compgen -G "$wheels/llama_cpp_python-$LLAMA_VERSION-*.whl" >/dev/null; then
      log "building the portable llama-cpp-python $LLAMA_VERSION wheel (5-9 minutes on 2 cores)"
      CMAKE_ARGS="$PORTABLE_CMAKE_ARGS" FORCE_CMAKE=1 python -m pip wheel --no-deps --no-cache-dir \
        --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -w "$wheels"
      slim_wheel "$wheels"/llama_cpp_python-$LLAMA_VERSION-*.whl
    fi
    if ((${#PURE_WHEELS[@]})); then
      log "downloading ${PURE_WHEELS[*]}"
      python -m pip download -q --no-deps -d "$wheels" "${PURE_WHEELS[@]}"
    fi
    log "the project"
    rm -f "$wheels"/hetero_spec-*.whl
    python -m pip wheel -q --no-deps "$ROOT" -w "$wheels"
  fi
  local model="${GPU_PROOF_MODEL:-}"
  [[ -n "$model" ]] || model="$(cd "$ROOT" && python scripts/default_model.py)"
  ln -sf "$model" "$stage/model.gguf"
  sha256sum < "$model" | awk '{print $1"  model.gguf"}' > "$dir/MODEL.sha256"  # of the joined file
  log "cutting parts of $((part / 1048576)) MiB (the checkout carries $((travel / 1048576)) MiB of every call)"
  rm -rf "$dir"/call-* "$dir/plots" "$dir/bundle.tar"
  NEXT=0
  tar -C "$stage" -chf "$dir/bundle.tar" wheels model.gguf
  cut_into_calls "$dir/bundle.tar" bundle.tar "$part" "$dir"
  rm -f "$dir/bundle.tar"
  local needed=$NEXT
  if [[ "${GPU_PROOF_PLOT_WHEELS:-1}" != 0 ]]; then
    local py="${GPU_PROOF_PYTHON_VERSION:-3.12}"
    log "matplotlib's wheels for Python $py"
    mkdir -p "$plots"
    python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$plots" "${PLATFORM_WHEELS[@]}"
    tar -C "$dir/plots" -cf "$dir/plots.tar" plot-wheels
    cut_into_calls "$dir/plots.tar" plots.tar "$part" "$dir"
    rm -rf "$dir/plots.tar" "$dir/plots"
  fi
  (cd "$dir" && sha256sum call-*/*.part-* | sed 's|  call-[0-9]*/|  |' > SHA256SUMS)
  local rel="$dir"
  [[ "$dir" == "$ROOT"/* ]] && rel="${dir#"$ROOT"/}"
  {
    echo "# $NEXT calls, each carrying one folder beside the checkout ($((travel / 1048576)) MiB); one after another,"
    echo "# each within the machine's idle time, since a machine given back keeps nothing.  With the device tool:"
    local n
    for ((n = 1; n <= NEXT; n++)); do
      local call; call="$(printf 'call-%02d' "$n")"
      local what="carry $rel/$call"
      ((n > needed)) && what="$what (matplotlib's wheels: only where python3 -c 'import matplotlib' fails)"
      echo "$what"
    done
    echo "# the command of the last call (or of one more, carrying nothing):"
    echo "GPU_PROOF_DIR=$rel OUT=\$OUT bash scripts/gpu_proof.sh run"
  } > "$dir/SEND_ORDER.txt"
  cp "$dir/SHA256SUMS" "$dir/MODEL.sha256" "$dir/SEND_ORDER.txt" "$dir/call-01/"
  log "wrote $NEXT call folders under $dir"
  cat "$dir/SEND_ORDER.txt"
}

# ------------------------------------------------------------------------------------------------ unpack
# unpack DIR WORK: check the parts found under DIR against its SHA256SUMS and join them into WORK
# (WORK/wheels, WORK/model.gguf, and WORK/plot-wheels where all of matplotlib's parts came)
unpack() {
  local dir work sums
  dir="$(cd "$1" && pwd)" && mkdir -p "$2" && work="$(cd "$2" && pwd)"
  sums="$(find "$dir" -maxdepth 2 -name SHA256SUMS | head -1)"
  [[ -n "$sums" ]] || die "no SHA256SUMS under $dir: send call-01 first"
  local name hash missing=() bad=()
  declare -A at=()
  while read -r hash name; do
    local f; f="$(find "$dir" -maxdepth 2 -name "$name" | head -1)"
    if [[ -z "$f" ]]; then
      [[ "$name" == bundle.tar.* ]] && missing+=("$name")
      continue
    fi
    [[ "$(sha256sum < "$f" | cut -d' ' -f1)" == "$hash" ]] || bad+=("$name")
    at[$name]="$f"
  done < "$sums"
  ((${#missing[@]} == 0)) || die "parts not here (send their calls again): ${missing[*]}"
  ((${#bad[@]} == 0)) || die "parts damaged on the way (send their calls again): ${bad[*]}"
  local prefix
  for prefix in bundle.tar plots.tar; do
    local parts=() all=1
    while read -r hash name; do
      [[ "$name" == "$prefix".* ]] || continue
      if [[ -n "${at[$name]:-}" ]]; then parts+=("${at[$name]}"); else all=0; fi
    done < "$sums"
    ((${#parts[@]})) && ((all)) && cat "${parts[@]}" | tar -x -C "$work"
  done
  (cd "$work" && sha256sum -c --quiet "$(dirname "$sums")/MODEL.sha256") || die "the joined model differs from the packed one"
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
  local positions="${GPU_PROOF_DRAFT_POSITIONS:-300}"  # the draft step's equality check, and its cached context
  local curve_timings="--quick"  # 3 timings a width; GPU_PROOF_CURVE_REPEATS sets another count
  [[ -n "${GPU_PROOF_CURVE_REPEATS:-}" ]] && curve_timings="--repeats $GPU_PROOF_CURVE_REPEATS"
  mkdir -p "$out"
  for t in $curve_threads; do
    log "1. verification curve, $t threads"
    timeout "$(left)" hetero-spec calibrate "$model" "$draft" -t "$t" $curve_timings --draft-device "$device" \
      --out "$out/curve-t$t.json" > "$out/curve-t$t.txt" || log "curve at $t threads did not finish"
  done
  log "2. the draft step on $device"
  timeout "$(left)" "$PY" "$scripts/bench_draft_step.py" "$model" "$draft" --device "$device" --rounds "$rounds" \
    --positions "$positions" --context "$positions" --json "$out/draft_step.json" > "$out/draft_step.txt" || log "draft step did not finish"
  log "3. bench: $methods on $sets, $prompts prompts, $tokens tokens, --draft-device $device"
  timeout "$(left)" hetero-spec bench "$model" "$draft" --datasets "$sets" --methods "$methods" \
    --n-prompts "$prompts" --max-new-tokens "$tokens" -t "$threads" --draft-device "$device" \
    --project laptop-7b-q4_0 --out "$out/bench" > "$out/bench.txt" || log "bench did not finish"
  [[ -f "$out/bench/bench.json" ]] && cp "$out/bench/bench.json" "$out/bench.json"
  [[ -f "$out/bench/speedup.png" ]] && cp "$out/bench/speedup.png" "$out/speedup.png"
  if [[ "$x10_prompts" -gt 0 ]]; then
    log "4. a x$x10_scale cost-equivalent target, then $x10_methods on it, $x10_prompts prompts a set"
    local x10="$WORK/x$x10_scale.gguf"
    [[ -f "$x10" ]] || timeout "$(left)" "$PY" "$scripts/make_cost_equivalent_target.py" "$model" "$x10" \
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

# collect RESULTS: what comes back in $OUT, where the device tool returns at most 8 files: the main ones, and
# everything (curves, each step's output, the bench folders) in results.tar.gz; log.txt is there already
collect() {
  local f
  for f in bench.json bench-x10.json draft_step.json speedup.png; do
    [[ -f "$1/$f" ]] && cp "$1/$f" "$OUT/"
  done
  tar -C "$1" -czf "$OUT/results.tar.gz" . 2>/dev/null || true
}

# ------------------------------------------------------------------------------------------------ run
run() {
  : "${OUT:?set OUT to the folder whose files come back}"
  local here="${GPU_PROOF_DIR:-$PWD}"
  [[ -f "$ROOT/$DRAFT_REL" ]] || die "run from a checkout of the repository: $ROOT has no $DRAFT_REL"
  DEADLINE=$(($(date +%s) + ${GPU_PROOF_BUDGET_S:-460}))
  WORK="${GPU_PROOF_WORK:-$here/work}"
  mkdir -p "$OUT" "$WORK"
  exec > >(tee -a "$OUT/log.txt") 2>&1
  log "checking and joining the parts under $here"
  unpack "$here" "$WORK"
  # Into a folder on PYTHONPATH, not a venv: the machine's python3 may itself be a venv's, whose packages
  # (torch) a venv made from it would not see, --system-site-packages or not.
  PY="${GPU_PROOF_PYTHON:-python3}"
  local site="$WORK/site" device="${GPU_PROOF_DEVICE:-cuda}"
  log "installing into $site for $PY (no network; the machine's own torch, transformers and numpy stay)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$WORK"/wheels/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  if ! "$PY" -c "import matplotlib" 2>/dev/null; then
    compgen -G "$WORK/plot-wheels/*.whl" >/dev/null || die "no matplotlib here: send the calls of its wheels too"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$WORK"/plot-wheels/*.whl
  fi
  "$PY" -c "import torch, llama_cpp, gguf, hetero_spec.cli
assert '$device' == 'cpu' or torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name() if '$device' != 'cpu' else 'GPU_PROOF_DEVICE=cpu: the draft on the CPU')"
  RESULTS="$WORK/results"  # global: the trap runs after run() has returned
  mkdir -p "$RESULTS"
  trap 'collect "$RESULTS"' EXIT
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RESULTS/gpu.txt" 2>/dev/null || true
  lscpu > "$RESULTS/cpu.txt" 2>/dev/null || true
  cd "$ROOT"
  steps "$device" "$WORK/model.gguf" "$ROOT/$DRAFT_REL" "$RESULTS" "$ROOT/scripts"
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
  slim-wheel) shift; slim_wheel "${1:?usage: gpu_proof.sh slim-wheel WHEEL}" ;;
  unpack) shift; unpack "${1:?usage: gpu_proof.sh unpack DIR WORK}" "${2:?usage: gpu_proof.sh unpack DIR WORK}" ;;
  cpu-check) shift; cpu_check "$@" ;;
  -h|--help) usage; exit 0 ;;
  *) usage; exit 2 ;;
esac
