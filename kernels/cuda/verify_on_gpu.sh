#!/usr/bin/env bash
# Verify and measure the CUDA backend on a GPU machine in one device call (issue 26).
#
#   bash kernels/cuda/verify_on_gpu.sh prepare     # here, no GPU needed: fills .gpu/, checks what travels
#   bash kernels/cuda/verify_on_gpu.sh all         # there: every phase below, 480 s at most
#   bash kernels/cuda/verify_on_gpu.sh PHASE...    # there: the named phases alone (a rerun of what failed)
#   VERIFY_WORK=DIR bash kernels/cuda/verify_on_gpu.sh key-figures   # here: the summary of DIR/logs again
#
# The device call (README, "GPU"): the device tool's `run` with command
#   `bash kernels/cuda/verify_on_gpu.sh all`, carry [".gpu"], timeout_s 540.
#
# prepare: the sm_90 cubin built with nvcc into .gpu/cuda-cache (the runtime finds it by the hash of
#   the sources: no NVRTC compile there), stories260K into .gpu/shared/models (../shared does not
#   travel), the cp312 manylinux wheels serving needs and the image lacks (h2, hpack, hyperframe,
#   orjson) into .gpu/wheels, the host path's C extensions for CPython 3.12 into .gpu/ext; then
#   checks the wheel names and that the carried size (the working tree as the tool sends it, plus
#   .gpu) is under the tool's 64 MiB. .gitignore keeps .gpu/ out of git.
# all: the phases in PHASES, most valuable first, each under its own `timeout`, within one deadline
#   of TOTAL_BUDGET seconds from the start, so a slow phase cuts only the tail:
#   env            nvidia-smi, driver, compute capability, the imports, the cubin found by its hash;
#                  when it fails, every other phase is skipped with its last line as the reason
#   kernels        every kernel against its numpy twin, each fused kernel against its unfused
#                  sequence; the max abs/rel error per kernel test (tests/conftest.py's table)
#   golden         stories260K greedy, cuda against the CPU exact path (graphs, eager, PDL off,
#                  fused, unfused, SIMT), unquantized against run.c's ids, overlapped steps against
#                  --no-overlap; on a mismatch the first differing token and the CPU top-2 gap
#   serve          `serve --backend cuda` (the embedded default model) driven by `bench load` at
#                  concurrency 1 and 64: /v1/completions (SSE), then /generate binary int32 ids
#   bench-fused    `bench engine --backend cuda`, 8B then 1B shape, batch 1,16,64, kernel profile
#   sweep          8B shape at batch 1, profiled: the plan (K split to one wave of each family's blocks a
#                  SM) with each product beside its weight-stream probe (the same grid and loads, nothing
#                  computed); the plan before (at least 2 a SM); variant r (x4's units in registers, not
#                  cp.async) at one wave of 3; then fp16 activations (one MMA per k step, not the exact
#                  hi/lo pair): prefill, batch 1 and 64
#   bench-unfused  the same with --unfused
#   sanitize       compute-sanitizer memcheck on one tiny-model greedy test, in whatever time is left
#   Logs and JSON go to $WORK/logs as they are written: $OUT holds two files (the device tool
#   returns 8 at most), logs.tar.gz (re-packed every few seconds, so a killed call still returns
#   it) and summary.txt (the plan, one line per phase, the key figures). The key figures are
#   printed last, so the end of the output, all a reply keeps, holds them.
# VERIFY_STUB=1 runs every phase as a one-line stand-in (tests/test_gpu_carry.py checks the plan,
#   the deadline and what lands in $OUT so); TOKENWIRE_FAKE_GPU=1 runs the kernel and golden
#   phases on the numpy stand-in driver (kernels/cuda/fake.py).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
GPU_DIR="$REPO/.gpu"
WORK="${VERIFY_WORK:-${TMPDIR:-/tmp}/tokenwire-verify}"       # outside the tree: never carried
LOGS="$WORK/logs"
OUT="${OUT:-$WORK/out}"
PY="${PYTHON:-python3}"
CARRY_LIMIT=$((64 * 1024 * 1024))      # bytes the device tool carries per call
TOTAL_BUDGET=480                       # seconds for every phase together; the call's timeout_s is 540
# name:seconds, in the order `all` runs them; the budgets sum to TOTAL_BUDGET at most
PHASES="env:25 kernels:60 golden:50 serve:60 bench-fused:100 sweep:120 bench-unfused:45 sanitize:20"
SERVE_PORT=8123
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# ------------------------------------------------------------------ prepare (here)

prepare() {
  mkdir -p "$GPU_DIR/shared/models" "$GPU_DIR/cuda-cache"
  git check-ignore -q .gpu/ || { echo "prepare: .gpu/ is not ignored by git (.gitignore must list /.gpu/)"; return 1; }
  rm -rf "$GPU_DIR/out"                                       # an old default $OUT: dead weight to carry
  local src="$REPO/../shared/models/stories260K"
  [ -d "$src" ] && cp -r "$src" "$GPU_DIR/shared/models/" && echo "copied stories260K into .gpu/shared/models"
  find_repo_package
  local cubin
  cubin="$(PYTHONSAFEPATH=1 "$PY" -c "from tokenwire.kernels.cuda import build; print(build.cached_path('sm_90', '$GPU_DIR/cuda-cache'))")"
  if [ -f "$cubin" ]; then
    echo "cubin for these sources already built: $(basename "$cubin")"
  else
    rm -f "$GPU_DIR"/cuda-cache/kernels-*                     # cubins of older sources: dead weight to carry
    timeout 900 env PYTHONSAFEPATH=1 "$PY" -m tokenwire.kernels.cuda.build --arch sm_90 --compiler nvcc \
      --cache-dir "$GPU_DIR/cuda-cache" || echo "prepare: no prebuilt cubin: the GPU machine will compile with NVRTC"
  fi
  prepare_wheels || return 1
  prepare_extensions
  check_carry
}

# The serving host path's C extensions (net/protocol/_frames.c, core/_rows.c, net/writer/_columns.c,
# kernels/cuda/_launch.c: Python.h and libc only) built for the image's CPython 3.12 into .gpu/ext, at
# their package paths;
# setup_env copies them into the tree there. The ones setup.py builds here are for this machine's
# Python, so without these the device runs their Python twins (same outputs, slower host path).
# Needs a CPython 3.12 with its headers here (PYTHON312, else pyenv's); without one, says so.
prepare_extensions() {
  local py312="${PYTHON312:-$(ls /root/.pyenv/versions/3.12*/bin/python3 2>/dev/null | tail -1)}" inc suffix src out
  rm -rf "$GPU_DIR/ext"
  if [ -z "$py312" ] || ! inc="$("$py312" -c "import sysconfig; print(sysconfig.get_paths()['include'])")" \
      || [ ! -f "$inc/Python.h" ]; then
    echo "prepare: no CPython 3.12 with headers here (set PYTHON312): the device runs the host path's Python twins"
    return 0
  fi
  suffix="$("$py312" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
  for src in net/protocol/_frames.c core/_rows.c net/writer/_columns.c kernels/cuda/_launch.c; do
    out="$GPU_DIR/ext/${src%.c}$suffix"
    mkdir -p "$(dirname "$out")"
    cc -shared -fPIC -O2 -std=c11 -fvisibility=hidden -I core -I "$inc" "$src" -o "$out" -ldl \
      || { echo "prepare: $src did not build for 3.12: the device runs its Python twin"; rm -f "$out"; }
  done
  echo "host extensions for $("$py312" -c 'import sys; print(sys.version.split()[0])'):" \
    "$(cd "$GPU_DIR/ext" 2>/dev/null && find . -name '*.so' | sort | tr '\n' ' ')"
}

prepare_wheels() {
  # a fresh folder each time: two versions of one package stop `pip install --no-index` there
  local fresh="$GPU_DIR/wheels.new"
  rm -rf "$fresh" && mkdir -p "$fresh"
  if ! timeout 300 "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$fresh" "h2>=4.1" "hpack>=4.0" "hyperframe>=6.0" "orjson>=3.8"; then
    rm -rf "$fresh"
    if compgen -G "$GPU_DIR/wheels/*.whl" >/dev/null; then echo "prepare: download failed, keeping the wheels there are"
    else echo "prepare: wheels not downloaded: serving on the GPU machine would fail to import h2/orjson"; return 1; fi
  else
    rm -rf "$GPU_DIR/wheels" && mv "$fresh" "$GPU_DIR/wheels"
  fi
  local bad=0
  for whl in "$GPU_DIR"/wheels/*.whl; do           # the image's Python is CPython 3.12 on x86-64 Linux
    if [[ "$(basename "$whl")" =~ -(py3-none-any|cp312-cp312-manylinux[a-z0-9_.]*x86_64)\.whl$ ]]; then
      echo "wheel: $(basename "$whl")"
    else
      echo "wheel NOT for the image (cp312 manylinux x86_64): $(basename "$whl")"; bad=1
    fi
  done
  return $bad
}

# the bytes the device tool sends: tracked and untracked-not-ignored files, plus .gpu (carried)
carried_bytes() {
  local tree gpu
  tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
  gpu=$(du -sb "$GPU_DIR" 2>/dev/null | cut -f1)
  echo "$tree ${gpu:-0}"
}

check_carry() {
  read -r tree gpu < <(carried_bytes)
  local total=$((tree + gpu))
  echo "carried: working tree $((tree / 1024)) KiB + .gpu $((gpu / 1024)) KiB = $((total / 1024)) KiB" \
       "of the tool's $((CARRY_LIMIT / 1024)) KiB"
  du -sh "$GPU_DIR"/* 2>/dev/null
  if [ "$total" -ge "$CARRY_LIMIT" ]; then echo "prepare: TOO BIG to carry"; return 1; fi
}

# ------------------------------------------------------------------ the machine's environment

# `tokenwire.*` must be this repository's code: when it is not importable as such, a package
# folder whose subpackages link to the repository's folders goes first on PYTHONPATH
find_repo_package() {
  if ! PYTHONSAFEPATH=1 "$PY" -c "import os, sys, tokenwire.kernels.cuda as m
sys.exit(not os.path.realpath(m.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))" "$REPO" 2>/dev/null; then
    local pkg
    pkg="$(mktemp -d)/tokenwire"
    mkdir -p "$pkg" && cp "$REPO"/tokenwire/*.py "$pkg"/
    for d in core kernels net engine_build bench; do [ -d "$REPO/$d" ] && ln -s "$REPO/$d" "$pkg/$d"; done
    export PYTHONPATH="$(dirname "$pkg")${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

setup_env() {
  export PYTHONUNBUFFERED=1
  # `python -m`, `-c` and stdin put the working directory first on sys.path, where the repository's
  # own tokenwire/ folder (no subpackages) would shadow the package find_repo_package assembles
  export PYTHONSAFEPATH=1
  [ -d "$GPU_DIR/cuda-cache" ] && export TOKENWIRE_CUDA_CACHE="$GPU_DIR/cuda-cache"
  # serving's wheels, installed once per machine into a folder of their own
  if compgen -G "$GPU_DIR/wheels/*.whl" >/dev/null && ! "$PY" -c "import h2, orjson" 2>/dev/null; then
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tw-site \
      "$GPU_DIR"/wheels/*.whl && export PYTHONPATH="/tmp/tw-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # the host path's C extensions prepare built for the image's Python: copied in only for a Python
  # of that ABI (a rehearsal here leaves the tree alone)
  if [ -d "$GPU_DIR/ext" ]; then
    local suffix f
    suffix="$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
    while IFS= read -r f; do cp "$GPU_DIR/ext/$f" "$REPO/$f"; done < <(cd "$GPU_DIR/ext" && find . -name "*$suffix")
  fi
  find_repo_package
  # the golden tests read ../shared/models (tests/conftest.py)
  if [ ! -f "$REPO/../shared/models/stories260K/stories260K.bin" ] && [ -d "$GPU_DIR/shared/models" ]; then
    mkdir -p "$REPO/../shared" && ln -sfn "$GPU_DIR/shared/models" "$REPO/../shared/models"
  fi
}

# ------------------------------------------------------------------ the phases (there)

phase_env() {
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  "$PY" - <<'EOF'
import importlib, os, sys
print(f"python {sys.version.split()[0]} at {sys.executable}")

def version(name):
    try:
        return getattr(importlib.import_module(name), "__version__", "present")
    except Exception as exc:
        return f"MISSING ({type(exc).__name__})"
print("packages:", ", ".join(f"{m} {version(m)}" for m in ("numpy", "cuda.bindings", "h2", "hpack", "hyperframe",
                                                           "orjson", "uvloop", "tokenizers", "pytest", "pytest_timeout")))
failed = []
for name in ("tokenwire.kernels.cuda.executor", "tokenwire.serve", "tokenwire.bench.engine_cuda", "tokenwire.bench.load"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("imports:", "; ".join(failed) or "the CUDA path, serve and the benchmarks import")
try:
    from tokenwire.core import scheduler
    from tokenwire.net.protocol import frames
    from tokenwire.net.writer import dispatch
    from tokenwire.kernels.cuda import driver as cuda_driver
    print("host C extensions:", ", ".join(f"{n} {'C' if ok else 'Python twin'}" for n, ok in
          (("frames", frames.NATIVE), ("rows", scheduler.ROWS is not None), ("columns", dispatch.COLUMNS is not None),
           ("launch", cuda_driver.C_LAUNCH is not None))))
except Exception as exc:
    print(f"host C extensions: not checked ({type(exc).__name__}: {exc})")
from tokenwire.kernels.cuda import build
print(f"compilers: nvrtc {build.nvrtc_available()}, nvcc {build.nvcc_path()}; cubin cache {build.cache_dir()}")
try:
    if os.environ.get("TOKENWIRE_FAKE_GPU") == "1":      # a rehearsal of the test phases without a GPU
        from tokenwire.kernels.cuda.fake import FakeDriver
        drv = FakeDriver(name="the numpy stand-in (TOKENWIRE_FAKE_GPU=1)")
    else:
        from tokenwire.kernels.cuda.driver import CudaDriver
        drv = CudaDriver(0)
    cc = drv.compute_capability
    free, total = drv.mem_get_info()
    print(f"gpu: {drv.name}, compute capability {cc[0]}.{cc[1]}, {drv.num_sms} SMs, {total / 2**30:.1f} GiB "
          f"({free / 2**30:.1f} free)")
except Exception as exc:
    print(f"env: FAILED: no usable GPU: {type(exc).__name__}: {exc}")
    sys.exit(3)
path = build.cached_path(f"sm_{cc[0]}{cc[1]}")
print(f"cubin: {'prebuilt, found by its hash' if path.is_file() else 'NOT prebuilt: NVRTC compiles at first use'}: "
      f"{path.name}")
# kernels launch, and a step's copies and events go, through ctypes (driver.NativeLaunch,
# NativeStreamOps); one upload, kernel and download done both ways must agree, or the later
# phases fall back to cuda-python's wrappers (LOGS/../phase.env), saying so
if getattr(drv, "native_launch", None) is not None:
    import numpy as np
    from tokenwire.kernels.cuda.device import Device
    dev = Device(drv, pdl=cc >= (9, 0))
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    ptrs = [drv.mem_alloc(x.nbytes) for _ in range(3)]
    drv.memcpy_htod_async(ptrs[0], x, x.nbytes, dev.compute_stream)
    drv.memcpy_htod_async(ptrs[1], np.ones(64, np.float32), 256, dev.compute_stream)
    results, native = {}, (drv.native_launch, drv.native_ops)
    try:
        for path, (launcher, ops) in (("native", native), ("cuda-python", (None, None))):
            drv.native_launch, drv.native_ops = launcher, ops
            drv.memset_async(ptrs[2], x.nbytes, dev.compute_stream)
            dev.launch("rmsnorm", (2,), 256, dev.compute_stream, x=ptrs[0], ldx=64, rows=0, w=ptrs[1], out=ptrs[2],
                       ldo=64, D=64, eps=1e-5, accumulate=0)
            got = np.zeros_like(x)
            drv.memcpy_dtoh_async(got, ptrs[2], x.nbytes, dev.compute_stream)
            drv.stream_synchronize(dev.compute_stream)
            results[path] = got
        same = np.array_equal(results["native"], results["cuda-python"]) and np.abs(results["native"]).max() > 0
        print(f"launch: ctypes launch and copies {'agree with' if same else 'DIFFER from'} cuda-python's")
    except Exception as exc:
        same = False
        print(f"launch: ctypes launch or copies FAILED: {type(exc).__name__}: {exc}")
    finally:
        drv.native_launch, drv.native_ops = native
    if not same:
        with open(os.environ.get("VERIFY_PHASE_ENV", os.devnull), "w") as f:
            f.write("export TOKENWIRE_CUDA_LAUNCH=python\n")
        print("launch: the phases below use cuda-python's launch (TOKENWIRE_CUDA_LAUNCH=python)")
print("env: FAILED: " + failed[0] if failed else "env: ok")
sys.exit(4 if failed else 0)
EOF
}

gpu_tests() {   # the gpu-marked tests of the files named, failures and skips listed at the end
  "$PY" -m pytest -v -p no:cacheprovider -m gpu --timeout 120 -o addopts="--strict-markers" -rfEs --tb=short "$@"
}

phase_kernels() { gpu_tests tests/test_cuda_kernels.py tests/test_cuda_fused.py; }

phase_golden() { gpu_tests tests/test_cuda_golden.py; }

phase_serve() {
  "$PY" -m tokenwire serve --backend "${SERVE_BACKEND:-cuda}" --port "$SERVE_PORT" ${SERVE_MODEL:+--model "$SERVE_MODEL"} \
    > "$LOGS/server.log" 2>&1 &
  local server=$! rc=0 url="http://127.0.0.1:$SERVE_PORT"
  local waited=0
  until "$PY" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1] + '/health', timeout=1)" "$url" \
      2>/dev/null; do
    kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$LOGS/server.log"; return 1; }
    [ $((waited += 1)) -gt 50 ] && { echo "the server was not ready after 50 s:"; tail -20 "$LOGS/server.log"; return 1; }
    sleep 1
  done
  echo "server ready after about $waited s"
  echo "-- /v1/completions, SSE, concurrency 1 and 64"
  "$PY" -m tokenwire bench load --url "$url/v1/completions" --concurrency 1,64 --server-pid $server \
    --json "$LOGS/serve-sse.json" || rc=$?
  echo "-- /generate, binary int32 ids (Accept: application/octet-stream), concurrency 1 and 64"
  "$PY" -m tokenwire bench load --url "$url/generate" --framing binary --concurrency 1,64 --server-pid $server \
    --json "$LOGS/serve-binary.json" || rc=$?
  kill $server; wait $server 2>/dev/null
  return $rc
}

bench_engine() {
  "$PY" -m tokenwire.bench.engine_cuda --shape llama-3.1-8b --shape llama-3.2-1b --batch 1,16,64 --steps 30 "$@"
}

phase_bench_fused() { bench_engine --profile --json "$LOGS/bench-fused.json"; }

phase_sweep() {   # 8B shape at batch 1, profiled: the products beside their probes, the plan before, variant r
  local name how
  for how in "plan --mm-probe" "before --mm-blocks-per-sm 2 --no-mm-one-wave" "r --mm-variant r --mm-blocks-per-sm 3"; do
    name=${how%% *}
    # shellcheck disable=SC2086
    "$PY" -m tokenwire.bench.engine_cuda --shape llama-3.1-8b --batch 1 --steps 20 --profile ${how#* } \
      --json "$LOGS/sweep-$name.json" || return $?
  done
  "$PY" -m tokenwire.bench.engine_cuda --shape llama-3.1-8b --batch 1,64 --steps 20 --int4-activations fp16 \
    --json "$LOGS/sweep-fp16.json" || return $?
}

phase_bench_unfused() { bench_engine --unfused --json "$LOGS/bench-unfused.json"; }

phase_sanitize() {
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
  [ -n "$sanitizer" ] || { echo "compute-sanitizer: not found"; return 127; }
  "$sanitizer" --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -x -p no:cacheprovider -m gpu \
    -o addopts="--strict-markers" "tests/test_cuda_golden.py::test_tiny_families_follow_the_reference[overrides0-engine0]"
}

# ------------------------------------------------------------------ running them

status_line() {      # NAME TEXT: one line on stdout and in the summary
  echo "== $1: $2" | tee -a "$LOGS/summary.txt" "$LOGS/phases.txt"
  cp "$LOGS/summary.txt" "$OUT/summary.txt"
}

# run_phase NAME LIMIT: phase_NAME under its own timeout, its output in $LOGS/NAME.log
run_phase() {
  local name="$1" limit="$2" t0=$SECONDS rc
  [ -f "$WORK/phase.env" ] && . "$WORK/phase.env"        # what the env phase found (TOKENWIRE_CUDA_LAUNCH)
  if [ -n "${VERIFY_STUB:-}" ]; then
    echo "stub of phase $name ($limit s)" > "$LOGS/$name.log"; rc=0
  else
    timeout --kill-after=5 "$limit" bash -c "phase_${name//-/_}" > "$LOGS/$name.log" 2>&1; rc=$?
  fi
  local status="ok"
  [ $rc -ne 0 ] && status="FAILED (rc $rc)"
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && status="TIMED OUT after ${limit} s"
  status_line "$name" "$status in $((SECONDS - t0)) s (logs/$name.log)"
  return $rc
}

pack() {             # the logs into $OUT/logs.tar.gz, replaced whole (rename) so a kill never leaves half
  tar -czf "$OUT/.logs.tar.gz.part" -C "$WORK" logs 2>/dev/null && mv -f "$OUT/.logs.tar.gz.part" "$OUT/logs.tar.gz"
}

start_packer() {
  rm -f "$WORK/stop-packer"
  ( while [ ! -e "$WORK/stop-packer" ]; do pack; sleep 3; done ) &
  PACKER=$!
}

stop_packer() {
  touch "$WORK/stop-packer"; wait "$PACKER" 2>/dev/null; pack
}

print_plan() {
  local sum=0 entry
  echo "== plan: phases in order, each under its own timeout, ${TOTAL_BUDGET} s for all of them from $(date -u +%T) UTC"
  for entry in $PHASES; do
    echo "   ${entry%%:*} ${entry#*:} s"; sum=$((sum + ${entry#*:}))
  done
  echo "   budgets sum to $sum s (of ${TOTAL_BUDGET}); sanitize runs only in the time left, at least 20 s"
  echo "   work folder $WORK, \$OUT $OUT"
}

run_phases() {       # env and the phases named (all when none), in PHASES order, within one deadline
  local deadline=$((SECONDS + TOTAL_BUDGET)) skip="" entry name budget left limit rc
  for entry in $PHASES; do
    name=${entry%%:*}; budget=${entry#*:}
    [ $# -eq 0 ] || [ "$name" = env ] || [[ " $* " == *" $name "* ]] || continue
    left=$((deadline - SECONDS))
    limit=$((budget < left ? budget : left))
    [ "$name" = sanitize ] && limit=$left
    if [ -n "$skip" ]; then status_line "$name" "skipped: $skip"; continue; fi
    if [ "$limit" -lt $([ "$name" = sanitize ] && echo 20 || echo 5) ]; then
      status_line "$name" "skipped: $left s left of the ${TOTAL_BUDGET} s"; continue
    fi
    run_phase "$name" "$limit"; rc=$?
    if [ "$name" = env ] && [ $rc -ne 0 ]; then
      skip="the environment phase failed (its last line, under key figures, says why)"
    fi
  done
}

key_figures() {      # from $LOGS: what a reader needs first, in at most about 10,000 characters
  echo "======== key figures (the rest: logs.tar.gz, read with \`tar -xzf logs.tar.gz\`; phase lines at the end)"
  echo "-- env"
  if grep -q "^env: ok" "$LOGS/env.log" 2>/dev/null; then
    grep -A1 "^name, driver_version" "$LOGS/env.log" | tail -1
    grep -E "^(gpu|cubin|imports|host C extensions|launch|env): " "$LOGS/env.log"
  else
    head -20 "$LOGS/env.log" 2>/dev/null | cut -c1-400
  fi
  for name in kernels golden; do
    [ -f "$LOGS/$name.log" ] || continue
    echo "-- $name"
    grep -E "^max-error " "$LOGS/$name.log"
    grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" | cut -c1-300 | head -15
    grep -E "first differing token|lengths differ" "$LOGS/$name.log" | cut -c1-300 | sort -u | head -8
    grep -E "^=+ .*[0-9]+ (passed|failed|skipped|error)" "$LOGS/$name.log" | tail -1
    grep -qE "^=+ .*[0-9]+ (passed|failed|skipped|error)" "$LOGS/$name.log" \
      || { echo "(no pytest summary: cut off; its last lines)"; tail -3 "$LOGS/$name.log" | cut -c1-300; }
  done
  if [ -f "$LOGS/serve.log" ]; then     # bench load's tables, less its client/server TTFT one and file notes
    echo "-- serve (µs unless ms)"
    awk '/srv ttft p50/ {skip = 1; next} skip && /^(http|---)/ {next} {skip = 0} !/^wrote |^\(|^\s*$/' \
      "$LOGS/serve.log" | sed -e "s#^http://127.0.0.1:$SERVE_PORT##" -e 's/^server \{21\}/server/' -e 's/^-\{21\}//' \
      | cut -c1-220 | tail -40
  fi
  for name in bench-fused sweep bench-unfused; do
    [ -f "$LOGS/$name.log" ] || continue
    echo "-- $name"
    awk '/^== / {print substr($0, 1, 110); next} /roofline \(|^ +batch|^ +[0-9]+ |prefill:|per eager launch|by part:|Error|error/ {print; next}
         /profile, decode step/ {print; top = 4; next} /weight-stream probes/ {print; top = 5; next}
         top > 0 {print; top--}' "$LOGS/$name.log" | cut -c1-220 | tail -50
  done
  [ -f "$LOGS/sanitize.log" ] && { echo "-- sanitize"; grep -E "ERROR SUMMARY|Invalid|passed|failed" "$LOGS/sanitize.log" | tail -6; }
  echo "-- phases"; cat "$LOGS/phases.txt" 2>/dev/null
}

run_on_gpu() {
  rm -rf "$LOGS" "$WORK/phase.env" && mkdir -p "$LOGS" "$OUT"
  export VERIFY_PHASE_ENV="$WORK/phase.env"
  : > "$LOGS/summary.txt"
  print_plan | tee "$LOGS/plan.txt"
  start_packer
  setup_env
  export PY LOGS OUT REPO GPU_DIR SERVE_PORT
  export -f $(compgen -A function phase_) gpu_tests bench_engine
  run_phases "$@"
  key_figures > "$LOGS/key-figures.txt"
  cat "$LOGS/key-figures.txt" >> "$LOGS/summary.txt"
  cp "$LOGS/summary.txt" "$OUT/summary.txt"
  stop_packer
  cat "$LOGS/key-figures.txt"
  ! grep -qE "^== .*(FAILED|TIMED OUT)" "$LOGS/summary.txt"
}

mode="${1:-all}"
case "$mode" in
  prepare) prepare ;;
  all) run_on_gpu ;;
  env|kernels|golden|serve|bench-fused|sweep|bench-unfused|sanitize) run_on_gpu "$@" ;;   # env runs first anyway
  key-figures) key_figures ;;        # again, from an unpacked logs.tar.gz: VERIFY_WORK=<the folder holding logs/>
  *) echo "usage: $0 prepare | all | PHASE... (one or more of: $(echo $PHASES | sed 's/:[0-9]*//g'))" >&2; exit 2 ;;
esac
