#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-server and llama-speculative-simple) from the llama.cpp
# source vendored in the llama-cpp-python sdist we pin, so that `hetero-spec bench`'s
# llama.cpp-ngram / llama.cpp-draft / llama.cpp-eagle3 methods run the very commit (and the
# same build options: native CPU flags, OpenMP, Release) as our bindings.  CPU backend only.
#
#   bash scripts/build_llama_cpp.sh                  # fetch the sdist with pip, build once
#   bash scripts/build_llama_cpp.sh --source DIR     # use an unpacked llama.cpp tree instead
#   bash scripts/build_llama_cpp.sh --force          # rebuild even if the binaries exist
#
# Output: ${XDG_CACHE_HOME:-~/.cache}/hetero-spec/llama.cpp-<llama-cpp-python version>/bin/
# (hetero_spec.bench.llama_tools looks there; HETERO_SPEC_LLAMA_CPP_BIN overrides).
# Needs cmake and a C++17 compiler (Debian: apt-get install cmake g++; ninja-build optional).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # must equal hetero_spec/target/_ffi.py PINNED_VERSION
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/hetero-spec/llama.cpp-${VERSION}"
JOBS="${JOBS:-2}"
SOURCE=""
FORCE=0
TARGETS=(llama-server llama-speculative-simple)

while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) SOURCE="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (use --source DIR, --force)" >&2; exit 2 ;;
  esac
done

have_all() { for t in "${TARGETS[@]}"; do [[ -x "$CACHE/bin/$t" ]] || return 1; done; }
if [[ $FORCE == 0 ]] && have_all; then
  echo "llama.cpp tools already built in $CACHE/bin (use --force to rebuild)"
  exit 0
fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found (Debian: apt-get install cmake g++)" >&2; exit 2; }
done

mkdir -p "$CACHE"
if [[ -z "$SOURCE" ]]; then
  SOURCE="$CACHE/src/llama_cpp_python-${VERSION}/vendor/llama.cpp"
  if [[ ! -f "$SOURCE/CMakeLists.txt" ]]; then
    echo "fetching the llama-cpp-python ${VERSION} sdist (its vendored llama.cpp is our bindings' commit)"
    # --no-binary for this package only: with :all: pip also builds the sdist's build requirements from source
    # before it can read its metadata (41 s against 4 s from an empty pip cache, and more where one fails to build)
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==${VERSION}" -d "$CACHE/sdist" -q
    mkdir -p "$CACHE/src"
    tar -xzf "$CACHE/sdist/llama_cpp_python-${VERSION}.tar.gz" -C "$CACHE/src"
  fi
fi
[[ -f "$SOURCE/CMakeLists.txt" && -f "$SOURCE/common/speculative.cpp" ]] || {
  echo "error: $SOURCE is not a llama.cpp source tree with common/speculative.cpp" >&2; exit 2; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
echo "building ${TARGETS[*]} from $SOURCE into $CACHE/bin"
echo "this takes several minutes on 2 cores (-j${JOBS}); it is done once"
# Same choices as llama-cpp-python's build of the bindings: Release, GGML_NATIVE (default ON),
# OpenMP (default ON).  Static libraries so the binaries need nothing beside them; no network
# features (no OpenSSL, no prebuilt web UI download), no GPU backends, no tests.
cmake -S "$SOURCE" -B "$CACHE/build" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >"$CACHE/cmake-configure.log" 2>&1 \
  || { tail -30 "$CACHE/cmake-configure.log" >&2; echo "error: cmake configure failed ($CACHE/cmake-configure.log)" >&2; exit 1; }
start=$(date +%s)
cmake --build "$CACHE/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" >"$CACHE/cmake-build.log" 2>&1 \
  || { tail -30 "$CACHE/cmake-build.log" >&2; echo "error: build failed ($CACHE/cmake-build.log)" >&2; exit 1; }
mkdir -p "$CACHE/bin"
for t in "${TARGETS[@]}"; do
  cp "$CACHE/build/bin/$t" "$CACHE/bin/$t"
done
{
  echo "llama_cpp_python=${VERSION}"
  echo "source=$SOURCE"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - start ))s with -j${JOBS}"
  echo "compiler=$(c++ --version | head -1)"
  echo "llama.cpp=$("$CACHE/bin/llama-server" --version 2>&1 | grep -m1 version || true)"
} >"$CACHE/bin/BUILD_INFO"
echo "built in $(( $(date +%s) - start ))s: $(ls "$CACHE/bin" | tr '\n' ' ')"
