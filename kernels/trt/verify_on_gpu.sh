#!/usr/bin/env bash
# Verify and measure the TensorRT backend on a GPU machine that cannot reach a package index.
#
#   kernels/trt/verify_on_gpu.sh prepare    # here (no GPU needed): wheels and the checkpoint into .gpu-trt/
#   kernels/trt/verify_on_gpu.sh run        # there, in the repository root, once every .gpu-trt/carry*/ is there
#
# prepare: `pip download`s TensorRT-RTX's real wheels ($TRT_WHEELS, default tensorrt-rtx-cu12-libs, about
#   95 MB, and tensorrt-rtx-cu12-bindings for this Python; the tensorrt-rtx-cu12 package itself is a stub
#   that fetches them from NVIDIA's index at install time) and onnx with its dependencies; cuts files into parts of
#   at most 48 MB and deals them into .gpu-trt/carry0/, carry1/, ... of at most 60 MB each, since the
#   device tool carries 64 MiB per call: carry [".gpu-trt/carry0"] with a no-op command, then
#   [".gpu-trt/carry1"] with `bash kernels/trt/verify_on_gpu.sh run` (the machine keeps ignored paths
#   between calls while it stays warm). Keeps .gpu-trt/ out of git through .git/info/exclude.
# run: joins the parts, installs the wheels from .gpu-trt/wheels without an index, prints TensorRT's
#   version and the GPU, then: the stories260K golden on real TensorRT (tests/test_trt_executor.py, gpu
#   marker), and `bench engine --backend trt` beside `--backend cuda` on llama-3.2-1b in the same run.
#   A builder that refuses the GPU shows its own message in the test output; logs go to $OUT.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
DIR="$REPO/.gpu-trt"
OUT="${OUT:-$DIR/out}"
PY="${PYTHON:-python3}"
PART_BYTES=48000000

prepare() {
  rm -rf "$DIR" && mkdir -p "$DIR/wheels"
  exclude="$(git rev-parse --git-path info/exclude 2>/dev/null)"     # worktrees too
  if [ -n "$exclude" ] && ! grep -qx '/.gpu-trt/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")" && echo '/.gpu-trt/' >> "$exclude"
  fi
  # shellcheck disable=SC2086
  "$PY" -m pip download --no-deps --only-binary=:all: -d "$DIR/wheels" \
    ${TRT_WHEELS:-tensorrt-rtx-cu12-libs tensorrt-rtx-cu12-bindings} \
    "onnx>=1.23" protobuf ml_dtypes typing_extensions || exit 1          # the export's needs (numpy assumed)
  for f in "$DIR"/wheels/*.whl; do
    if [ "$(stat -c %s "$f")" -gt "$PART_BYTES" ]; then
      split -b "$PART_BYTES" -d "$f" "$f.part" && rm "$f" && echo "split $(basename "$f")"
    fi
  done
  mkdir -p "$DIR/wheels/models" && cp -r "$REPO/../shared/models/stories260K" "$DIR/wheels/models/"
  n=0; used=0
  for f in "$DIR"/wheels/*; do                 # deal files into carry dirs of at most 60 MB
    size=$(du -sb "$f" | cut -f1)
    if [ $((used + size)) -gt 60000000 ] && [ "$used" -gt 0 ]; then n=$((n + 1)); used=0; fi
    mkdir -p "$DIR/carry$n" && mv "$f" "$DIR/carry$n/" && used=$((used + size))
  done
  rmdir "$DIR/wheels"
  du -sh "$DIR"/carry*
}

run() {
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  mkdir -p "$DIR/wheels"
  cp -r "$DIR"/carry*/* "$DIR/wheels/" 2>/dev/null
  for first in "$DIR"/wheels/*.whl.part00; do
    [ -e "$first" ] || continue
    whl="${first%.part00}"
    cat "$whl".part* > "$whl" && rm "$whl".part*
  done
  "$PY" -m pip install --no-index --no-deps -q "$DIR"/wheels/*.whl 2>&1 | tail -3
  if [ ! -f "$REPO/../shared/models/stories260K/stories260K.bin" ] && [ -d "$DIR/wheels/models" ]; then
    mkdir -p "$REPO/../shared" && ln -sfn "$DIR/wheels/models" "$REPO/../shared/models"
  fi
  if ! "$PY" -c "import tokenwire.kernels.trt" 2>/dev/null; then
    pkg="$(mktemp -d)/tokenwire"
    mkdir -p "$pkg" && cp "$REPO"/tokenwire/*.py "$pkg"/
    for d in core kernels net engine_build bench; do ln -s "$REPO/$d" "$pkg/$d"; done
    export PYTHONPATH="$(dirname "$pkg")${PYTHONPATH:+:$PYTHONPATH}"
  fi
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
  "$PY" -c "from tokenwire.kernels.trt.engine import import_tensorrt as i; t = i(); print(t.__name__, t.__version__)" 2>&1
  echo "== tests (gpu marker)"
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_trt_executor.py 2>&1 | tee "$OUT/tests.log" | tail -15
  echo "== bench engine: trt, then cuda, same machine, same run"
  "$PY" -m tokenwire bench engine --backend trt --shape llama-3.2-1b --batch 1,8,32 --json "$OUT/trt.json" \
    2>&1 | tee "$OUT/bench_trt.log" | tail -12
  "$PY" -m tokenwire bench engine --backend cuda --shape llama-3.2-1b --batch 1,8,32 --json "$OUT/cuda.json" \
    2>&1 | tee "$OUT/bench_cuda.log" | tail -12
}

case "${1:-run}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
