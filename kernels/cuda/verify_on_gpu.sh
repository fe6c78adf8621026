#!/usr/bin/env bash
# Verify and measure the CUDA backend on a GPU machine in one go.
#
#   kernels/cuda/verify_on_gpu.sh prepare    # here, on the development machine (no GPU needed)
#   kernels/cuda/verify_on_gpu.sh run        # there, in the repository root, with .gpu/ carried along
#                                            # (= `tests` then `bench`; each alone if one call must stay short)
#   kernels/cuda/verify_on_gpu.sh sanitize   # there: the kernel tests under compute-sanitizer memcheck
#
# prepare: builds the sm_90 cubin with nvcc into .gpu/cuda-cache (the runtime finds it by source hash;
#   without it the GPU machine compiles with NVRTC at first use), copies the stories260K checkpoint
#   into .gpu/shared/models (the golden test needs it; ../shared does not travel), and keeps .gpu/ out
#   of git through .git/info/exclude. Then call the device tool with carry [".gpu"] and the command
#   `bash kernels/cuda/verify_on_gpu.sh run`.
# run: GPU tests (every kernel against numpy; stories260K golden and batched/sampled decode against
#   the CPU backend), then `bench engine --backend cuda` on llama-3.2-1b and llama-3.1-8b shapes,
#   without and with programmatic dependent launch. Compact output; full logs and JSON go to $OUT.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
GPU_DIR="$REPO/.gpu"
OUT="${OUT:-$GPU_DIR/out}"
PY="${PYTHON:-python3}"
mode="${1:-run}"

prepare() {
  mkdir -p "$GPU_DIR/shared/models" "$GPU_DIR/cuda-cache"
  if [ -d .git ] && ! grep -qx '/.gpu/' .git/info/exclude 2>/dev/null; then echo '/.gpu/' >> .git/info/exclude; fi
  src="$REPO/../shared/models/stories260K"
  [ -d "$src" ] && cp -r "$src" "$GPU_DIR/shared/models/" && echo "copied stories260K into .gpu/shared/models"
  "$PY" -m tokenwire.kernels.cuda.build --arch sm_90 --compiler nvcc --cache-dir "$GPU_DIR/cuda-cache" \
    || echo "no prebuilt cubin: the GPU machine will compile with NVRTC"
  du -sh "$GPU_DIR"
}

setup_env() {
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  [ -d "$GPU_DIR/cuda-cache" ] && export TOKENWIRE_CUDA_CACHE="$GPU_DIR/cuda-cache"
  # `tokenwire.*` without pip: a package folder whose subpackages link to the repository folders
  if ! "$PY" -c "import tokenwire.kernels.cuda" 2>/dev/null; then
    pkg="$(mktemp -d)/tokenwire"
    mkdir -p "$pkg" && cp "$REPO"/tokenwire/*.py "$pkg"/
    for d in core kernels net engine_build bench; do ln -s "$REPO/$d" "$pkg/$d"; done
    export PYTHONPATH="$(dirname "$pkg")${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # the golden test reads ../shared/models (tests/conftest.py)
  if [ ! -f "$REPO/../shared/models/stories260K/stories260K.bin" ] && [ -d "$GPU_DIR/shared/models" ]; then
    mkdir -p "$REPO/../shared" && ln -sfn "$GPU_DIR/shared/models" "$REPO/../shared/models"
  fi
}

report_env() {
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | head -2
  "$PY" - <<'EOF' 2>&1
import sys
print("python", sys.version.split()[0])
try:
    import numpy, cuda.bindings
    print("numpy", numpy.__version__, "| cuda-bindings", getattr(cuda.bindings, "__version__", "?"))
    from tokenwire.kernels.cuda import build
    print("nvrtc", build.nvrtc_available(), "| nvcc", build.nvcc_path(), "| cache", build.cache_dir())
except Exception as exc:
    print("environment problem:", type(exc).__name__, exc)
EOF
}

run_tests() {
  echo "== GPU tests (kernels vs numpy, golden vs CPU backend)"
  "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 600 -o addopts="-ra --strict-markers" \
    tests/test_cuda_kernels.py tests/test_cuda_golden.py 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" | tail -40
}

run_bench() {
  local tag="$1"; shift
  echo "== bench engine --backend cuda ($tag)"
  "$PY" -m tokenwire.bench.engine_cuda --batch 1,8,32,128 --json "$OUT/bench-$tag.json" "$@" 2>&1 \
    | tee "$OUT/bench-$tag.log" | grep -v "^$"
}

case "$mode" in
  prepare) prepare ;;
  run|tests|bench)
    setup_env; report_env
    start=$(date +%s)
    [ "$mode" != bench ] && run_tests
    if [ "$mode" != tests ]; then
      both="--shape llama-3.2-1b --shape llama-3.1-8b"
      run_bench exact $both --profile
      run_bench exact-pdl $both --pdl
      run_bench fp16-pdl --shape llama-3.1-8b --pdl --int4-activations fp16 --profile
    fi
    echo "== done in $(( $(date +%s) - start )) s; logs and JSON in $OUT"
    ;;
  sanitize)
    setup_env
    echo "== compute-sanitizer memcheck on the kernel tests"
    compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider -m gpu \
      -o addopts="" tests/test_cuda_kernels.py 2>&1 | tee "$OUT/sanitize.log" | tail -30
    ;;
  *) echo "usage: $0 prepare|run|tests|bench|sanitize" >&2; exit 2 ;;
esac
