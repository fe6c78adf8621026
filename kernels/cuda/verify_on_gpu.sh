#!/usr/bin/env bash
# Verify and measure the CUDA backend on a GPU machine in one go.
#
#   kernels/cuda/verify_on_gpu.sh prepare    # here, on the development machine (no GPU needed)
#   kernels/cuda/verify_on_gpu.sh run        # there, in the repository root, with .gpu/ carried along:
#                                            # GPU tests, then bench fused and unfused (about 9 minutes at most)
#   kernels/cuda/verify_on_gpu.sh tests      # there: the GPU tests alone
#   kernels/cuda/verify_on_gpu.sh bench      # there: the benchmarks alone (fused, unfused, fused fp16)
#   kernels/cuda/verify_on_gpu.sh serve      # there: `serve --backend cuda` driven by `bench load`
#   kernels/cuda/verify_on_gpu.sh sanitize   # there: the kernel tests under compute-sanitizer memcheck
#
# prepare: builds the sm_90 cubin with nvcc into .gpu/cuda-cache (the runtime finds it by source
#   hash; without it the GPU machine compiles with NVRTC at first use), copies the stories260K
#   checkpoint into .gpu/shared/models (the golden test needs it; ../shared does not travel), and
#   downloads the cp312 manylinux wheels serving needs and the GPU image lacks (h2, hpack,
#   hyperframe, orjson) into .gpu/wheels; .gitignore keeps .gpu/ out of git. Then call the device
#   tool with carry [".gpu"] and the command `bash kernels/cuda/verify_on_gpu.sh run`.
# run: GPU tests (every kernel against numpy, each fused kernel against its unfused sequence;
#   stories260K golden and batched/sampled decode against the CPU backend), then `bench engine
#   --backend cuda` on llama-3.2-1b and llama-3.1-8b shapes, fused (the default) and unfused.
#   Every phase runs under its own `timeout`, together inside the GPU machine's 10-minute limit
#   per command, and writes its log under $OUT as it goes; the key figures are printed last, so
#   the end of the output (what a truncated reply keeps) holds them.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
GPU_DIR="$REPO/.gpu"
OUT="${OUT:-$GPU_DIR/out}"
PY="${PYTHON:-python3}"
mode="${1:-run}"
# seconds per phase: together they stay under the 600 s a device-tool command may run
T_TESTS="${T_TESTS:-150}"
T_BENCH="${T_BENCH:-110}"
T_SERVE="${T_SERVE:-240}"

prepare() {
  mkdir -p "$GPU_DIR/shared/models" "$GPU_DIR/cuda-cache" "$GPU_DIR/wheels"
  git check-ignore -q .gpu 2>/dev/null || echo "warning: .gpu/ is not ignored by git (.gitignore lists /.gpu/)"
  src="$REPO/../shared/models/stories260K"
  [ -d "$src" ] && cp -r "$src" "$GPU_DIR/shared/models/" && echo "copied stories260K into .gpu/shared/models"
  setup_env
  rm -f "$GPU_DIR"/cuda-cache/kernels-*                     # cubins of older sources: dead weight to carry
  timeout 900 "$PY" -m tokenwire.kernels.cuda.build --arch sm_90 --compiler nvcc --cache-dir "$GPU_DIR/cuda-cache" \
    || echo "no prebuilt cubin: the GPU machine will compile with NVRTC"
  # the GPU image has Python 3.12 and none of these; pure-Python ones come as py3 wheels, orjson as cp312
  timeout 300 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$GPU_DIR/wheels" \
    "h2>=4.1" "hpack>=4.0" "hyperframe>=6.0" "orjson>=3.8" \
    || echo "wheels not downloaded: serving on the GPU machine will fail to import h2/orjson"
  ls "$GPU_DIR/wheels"
  du -sh "$GPU_DIR"
}

setup_env() {
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  # `python -m`, `-c` and stdin put the working directory first on sys.path, where the repository's
  # own tokenwire/ folder (no subpackages) would shadow the package assembled below
  export PYTHONSAFEPATH=1
  [ -d "$GPU_DIR/cuda-cache" ] && export TOKENWIRE_CUDA_CACHE="$GPU_DIR/cuda-cache"
  # serving's wheels, installed once per machine into a folder of their own
  if compgen -G "$GPU_DIR/wheels/*.whl" >/dev/null && ! "$PY" -c "import h2, orjson" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tw-site \
      "$GPU_DIR"/wheels/*.whl && export PYTHONPATH="/tmp/tw-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # `tokenwire.*` without pip: a package folder whose subpackages link to the repository folders
  # (also when another checkout's tokenwire is installed: it must be this repository's code)
  if ! "$PY" -c "import os, sys, tokenwire.kernels.cuda as m
sys.exit(not os.path.realpath(m.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))" "$REPO" 2>/dev/null; then
    pkg="$(mktemp -d)/tokenwire"
    mkdir -p "$pkg" && cp "$REPO"/tokenwire/*.py "$pkg"/
    for d in core kernels net engine_build bench; do [ -d "$REPO/$d" ] && ln -s "$REPO/$d" "$pkg/$d"; done
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
  timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/env.log"
import sys
print("python", sys.version.split()[0])
try:
    import numpy, cuda.bindings
    print("numpy", numpy.__version__, "| cuda-bindings", getattr(cuda.bindings, "__version__", "?"))
    from tokenwire.kernels.cuda import build
    print("nvrtc", build.nvrtc_available(), "| nvcc", build.nvcc_path(), "| cache", build.cache_dir())
    import h2, orjson
    print("h2", h2.__version__, "| orjson", orjson.__version__)
except Exception as exc:
    print("environment problem:", type(exc).__name__, exc)
EOF
}

# phase NAME SECONDS CMD...: run under its own timeout, full log in $OUT/NAME.log, one status line
phase() {
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status="rc $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="TIMED OUT after ${limit}s"
  echo "== $name: $status in $(( $(date +%s) - t0 )) s (log: $name.log)" | tee -a "$OUT/summary.log"
  return $rc
}

run_tests() {
  phase gpu-kernels "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 120 \
    -o addopts="-ra --strict-markers" tests/test_cuda_kernels.py tests/test_cuda_fused.py
  phase gpu-golden "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 120 \
    -o addopts="-ra --strict-markers" tests/test_cuda_golden.py
}

run_bench() {
  local tag="$1"; shift
  phase "bench-$tag" "$T_BENCH" "$PY" -m tokenwire.bench.engine_cuda --batch 1,8,32,128 --steps 30 \
    --json "$OUT/bench-$tag.json" "$@"
}

serve_and_load() {
  # `serve --backend cuda` (the embedded default model, or $SERVE_MODEL) driven by `bench load`
  "$PY" -m tokenwire serve --backend "${SERVE_BACKEND:-cuda}" --port 8123 ${SERVE_MODEL:+--model "$SERVE_MODEL"} > "$OUT/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 120); do
    "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=1)" 2>/dev/null && break
    kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$OUT/server.log"; return 1; }
    sleep 1
  done
  "$PY" -m tokenwire bench load --url http://127.0.0.1:8123/v1/completions --concurrency 1,8,64 --server-pid $server \
    --json "$OUT/serve-load.json"
  local rc=$?
  kill $server; wait $server 2>/dev/null
  return $rc
}

summary() {
  echo "== key figures"
  for f in "$OUT"/gpu-*.log; do
    [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|deselected|error)' "$f" | tail -6)"
  done
  grep -h -E "top-2 gap|first differing" "$OUT"/gpu-golden.log 2>/dev/null | head -5
  for f in "$OUT"/bench-*.log "$OUT"/serve-load.log; do
    [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; grep -v '^$' "$f" | tail -14; }
  done
  cat "$OUT/summary.log" 2>/dev/null
}

case "$mode" in
  prepare) prepare ;;
  run|tests|bench)
    setup_env; report_env
    start=$(date +%s)
    : > "$OUT/summary.log"
    [ "$mode" != bench ] && run_tests
    if [ "$mode" != tests ]; then
      both="--shape llama-3.2-1b --shape llama-3.1-8b"
      run_bench fused $both --profile
      run_bench unfused $both --unfused --no-pdl
      [ "$mode" = bench ] && run_bench fused-fp16 --shape llama-3.1-8b --int4-activations fp16
    fi
    echo "== done in $(( $(date +%s) - start )) s; logs and JSON in $OUT"
    summary
    ;;
  serve)
    SERVE_MODEL="${SERVE_MODEL:-}" SERVE_BACKEND="${SERVE_BACKEND:-cuda}"
    setup_env; report_env
    : > "$OUT/summary.log"
    export -f serve_and_load; export PY OUT SERVE_MODEL SERVE_BACKEND
    phase serve-load "$T_SERVE" bash -c serve_and_load
    summary
    ;;
  sanitize)
    setup_env
    : > "$OUT/summary.log"
    phase sanitize 500 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider \
      -m gpu -o addopts="" tests/test_cuda_kernels.py
    tail -30 "$OUT/sanitize.log"
    ;;
  *) echo "usage: $0 prepare|run|tests|bench|serve|sanitize" >&2; exit 2 ;;
esac
