#!/usr/bin/env bash
# Verify and measure the TensorRT backend on a GPU machine that cannot reach a package index.
#
#   kernels/trt/verify_on_gpu.sh prepare    # here (no GPU): wheels and the checkpoint into .gpu-trt/
#   kernels/trt/verify_on_gpu.sh run        # there, in the repository root, once every .gpu-trt/carry*/ is there
#
# Spend no GPU time on this yet (issue 26): the full TensorRT builder is not obtainable here
# (PyPI's tensorrt-cu12/cu13-libs are stubs that fetch the libraries from NVIDIA's index at
# install time, which the GPU machine cannot reach), and TensorRT for RTX, the one real wheel,
# lists no compute capability 9.0, which the device tool's H100 and H200 are. Run it where
# either changes.
#
# prepare: `pip download`s TensorRT-RTX's real wheels for the GPU image (CPython 3.12, x86-64
#   manylinux, CUDA 13): $TRT_WHEELS, default tensorrt-rtx-cu13-libs and tensorrt-rtx-cu13-bindings
#   (1.7.1.116 on PyPI on 2026-11-27: the bindings cp312 manylinux_2_28, the libraries py3
#   manylinux_2_28; the tensorrt-rtx-cu13 package itself is a stub like the others). onnx,
#   protobuf, ml-dtypes and numpy, the export's needs, are on the image
#   (kernels/cuda/gpu_image_packages.txt). The wheels are kept in .gpu-trt/download, which pip
#   does not download again; the carry folders are remade from it: files cut into parts of at
#   most 48 MB and dealt into .gpu-trt/carry0/, carry1/, ... of at most 60 MB each, since the
#   device tool carries 64 MiB per call: carry [".gpu-trt/carry0"] with a no-op command, then
#   [".gpu-trt/carry1"] with `bash kernels/trt/verify_on_gpu.sh run` (the machine keeps ignored
#   paths between calls while it stays warm). .gitignore keeps .gpu-trt/ out of git.
# run: joins the parts, installs the wheels without an index, prints TensorRT's version and the
#   GPU, then the stories260K golden on real TensorRT (tests/test_trt_executor.py, gpu marker) and
#   `bench engine --backend trt` beside `--backend cuda` on llama-3.2-1b. Each step runs under its
#   own `timeout` (TIMEOUTS below, 480 s together, inside the tool's 10 minutes per command);
#   logs and JSON go to $OUT (6 files; the tool returns 8 at most). A builder that refuses the
#   GPU shows its own message in the test output.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
DIR="$REPO/.gpu-trt"
OUT="${OUT:-$DIR/out}"
PY="${PYTHON:-python3}"
PART_BYTES=48000000
T_INSTALL=60; T_TESTS=180; T_BENCH_TRT=150; T_BENCH_CUDA=90      # seconds: 480 together

prepare() {
  mkdir -p "$DIR/download"
  git check-ignore -q .gpu-trt/ || { echo "prepare: .gpu-trt/ is not ignored by git (.gitignore must list /.gpu-trt/)"; exit 1; }
  # shellcheck disable=SC2086
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR/download" ${TRT_WHEELS:-tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings} || exit 1
  rm -rf "$DIR"/carry* "$DIR/wheels" && mkdir -p "$DIR/wheels"
  for f in "$DIR"/download/*.whl; do
    if [ "$(stat -c %s "$f")" -gt "$PART_BYTES" ]; then
      split -b "$PART_BYTES" -d "$f" "$DIR/wheels/$(basename "$f").part" && echo "split $(basename "$f")"
    else
      cp "$f" "$DIR/wheels/"
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
  ls "$DIR/download"
  du -sh "$DIR"/carry*
}

# step NAME SECONDS CMD...: under its own timeout, output in $OUT/NAME.log, its tail shown
step() {
  local name="$1" limit="$2"; shift 2
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "== $name: TIMED OUT after $limit s"
  echo "== $name: rc $rc"; tail -12 "$OUT/$name.log"
}

run() {
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
  mkdir -p "$DIR/wheels"
  cp -r "$DIR"/carry*/* "$DIR/wheels/" 2>/dev/null
  for first in "$DIR"/wheels/*.whl.part00; do
    [ -e "$first" ] || continue
    whl="${first%.part00}"
    cat "$whl".part* > "$whl" && rm "$whl".part*
  done
  step install "$T_INSTALL" "$PY" -m pip install --no-index --no-deps -q --target /tmp/tw-trt "$DIR"/wheels/*.whl
  export PYTHONPATH="/tmp/tw-trt${PYTHONPATH:+:$PYTHONPATH}"
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
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>&1 | head -2
  timeout 30 "$PY" -c "from tokenwire.kernels.trt.engine import import_tensorrt as i; t = i(); print(t.__name__, t.__version__)" 2>&1
  step tests "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 120 tests/test_trt_executor.py
  step bench_trt "$T_BENCH_TRT" "$PY" -m tokenwire bench engine --backend trt --shape llama-3.2-1b --batch 1,8,32 \
    --json "$OUT/trt.json"
  step bench_cuda "$T_BENCH_CUDA" "$PY" -m tokenwire bench engine --backend cuda --shape llama-3.2-1b --batch 1,8,32 \
    --json "$OUT/cuda.json"
}

case "${1:-run}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
