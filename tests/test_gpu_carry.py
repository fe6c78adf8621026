"""The one GPU call fits the device tool (issue 26): what travels is under its 64 MiB, and
`kernels/cuda/verify_on_gpu.sh all` keeps to its 480 s plan and to the 8 files the tool returns.

The carried size is the working tree as the tool sends it (git's tracked and untracked-not-ignored
files) plus .gpu/. Where `verify_on_gpu.sh prepare` has filled .gpu/ that is measured; elsewhere
(CI) .gpu/'s parts are estimated from the sizes prepare produced (CUBIN_BYTES, WHEEL_BYTES) and
the checkpoint where it is present, so the test runs without network, nvcc or a GPU and fails
honestly when the tree itself grows too big. Where .gpu/ exists, its parts must also fit the
estimates, which keeps them true. `all` runs with VERIFY_STUB=1 (each phase a one-line stand-in):
the plan, the deadline, the files under $OUT and the archive are the script's own.
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO, STORIES260K, gpu_unavailable_reason

SCRIPT = REPO / "kernels" / "cuda" / "verify_on_gpu.sh"
GPU_DIR = REPO / ".gpu"
CARRY_LIMIT = 64 << 20            # the device tool's bytes per call (its README, Limits)
MAX_FILES_BACK = 8                # files the device tool returns from $OUT
MAX_SECONDS = 480                 # the call is given timeout_s 540: the machine's 10 minutes less margin
CUBIN_BYTES = 8 << 20             # sm_90 cubin: 3.9 MB with nvcc 13.0 on 2026-11-27; twice that for growth
WHEEL_BYTES = 1 << 20             # h2, hpack, hyperframe, orjson cp312: 248 KB on 2026-11-27
STORIES_BYTES = 2 << 20           # stories260K with its tokenizer files: 1.1 MB


def tree_bytes() -> int:
    try:
        names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                               check=True, timeout=60).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout here ({exc}): the carried tree is git's files")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def gpu_folder_parts() -> dict:
    """.gpu/'s parts as prepare makes them: measured where present, else estimated."""
    if GPU_DIR.is_dir():
        return {"cuda-cache": folder_bytes(GPU_DIR / "cuda-cache"), "wheels": folder_bytes(GPU_DIR / "wheels"),
                "rest": folder_bytes(GPU_DIR) - folder_bytes(GPU_DIR / "cuda-cache") - folder_bytes(GPU_DIR / "wheels")}
    stories = folder_bytes(STORIES260K) if STORIES260K.is_dir() else STORIES_BYTES
    return {"cuda-cache (estimate)": CUBIN_BYTES, "wheels (estimate)": WHEEL_BYTES, "rest": stories}


def test_what_travels_is_under_the_device_tools_64_mib():
    parts = {"tree": tree_bytes(), **gpu_folder_parts()}
    total = sum(parts.values())
    assert total < CARRY_LIMIT, f"{total / 2**20:.1f} MiB would travel, over 64 MiB: " + \
        ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
    if GPU_DIR.is_dir():        # prepared here: the estimates CI relies on must hold
        assert parts["cuda-cache"] <= CUBIN_BYTES and parts["wheels"] <= WHEEL_BYTES, parts


def test_gpu_folder_is_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu/"], cwd=REPO, timeout=60).returncode == 0


@pytest.mark.parametrize("script", ["kernels/cuda/verify_on_gpu.sh", "kernels/trt/verify_on_gpu.sh"])
def test_the_gpu_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def run_all(tmp_path, **env) -> tuple:
    """`verify_on_gpu.sh all` with its work folder and $OUT in tmp_path -> (completed process, seconds, out)."""
    out = tmp_path / "out"
    start = time.monotonic()
    base = {k: v for k, v in os.environ.items() if k not in ("VERIFY_STUB", "TOKENWIRE_FAKE_GPU", "PYTHONPATH")}
    done = subprocess.run(["bash", str(SCRIPT), "all"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**base, "OUT": str(out), "VERIFY_WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
                               **env})
    return done, time.monotonic() - start, out


def plan(stdout: str) -> tuple:
    """(total budget, [(phase, seconds)]) from the plan `all` prints first."""
    total = int(re.search(r"(\d+) s for all of them", stdout).group(1))
    phases = re.findall(r"^   ([a-z-]+) (\d+) s$", stdout, re.M)
    return total, [(name, int(s)) for name, s in phases]


def check_out_folder(out: Path) -> set:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES_BACK, files
    assert {p.name for p in files} == {"logs.tar.gz", "summary.txt"}
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"logs/summary.txt", "logs/plan.txt", "logs/env.log"} <= names
    return names


def test_all_keeps_to_its_plan_and_to_the_files_the_tool_returns(tmp_path):
    done, seconds, out = run_all(tmp_path, VERIFY_STUB="1")
    assert done.returncode == 0, done.stdout + done.stderr
    total, phases = plan(done.stdout)
    assert [name for name, _ in phases] == ["env", "kernels", "golden", "serve", "bench-fused", "sweep", "bench-unfused",
                                            "sanitize"]
    assert total <= MAX_SECONDS and sum(s for _, s in phases) <= total
    names = check_out_folder(out)
    assert {f"logs/{name}.log" for name, _ in phases} <= names
    # the key figures come last, ending with one line per phase: what a truncated reply keeps
    tail = done.stdout.rstrip().splitlines()[-len(phases):]
    assert [line.split(":")[0] for line in tail] == [f"== {name}" for name, _ in phases]
    assert seconds < 30


def test_the_documented_device_call_leaves_the_plan_a_margin():
    readme = (REPO / "README.md").read_text()
    call = re.search(r"`bash kernels/cuda/verify_on_gpu.sh all`.{0,200}?timeout_s[^0-9]{0,20}(\d+)", readme, re.S)
    assert call, "README must give the device call: the command, carry and timeout_s"
    assert int(call.group(1)) >= MAX_SECONDS + 45          # kill-after grace, setup and the final archive
    assert int(call.group(1)) <= 600                       # the tool's limit per command


def test_without_a_gpu_all_fails_fast_saying_why(tmp_path):
    if shutil.which("nvidia-smi") or gpu_unavailable_reason() is None:
        pytest.skip("a GPU (or the stand-in) is here: `all` would run for real")
    done, seconds, out = run_all(tmp_path)
    assert done.returncode != 0
    assert "env: FAILED: no usable GPU" in done.stdout           # env.log's verdict, in the key figures
    _, phases = plan(done.stdout)
    env, *rest = done.stdout.rstrip().splitlines()[-len(phases):]
    assert len(rest) == len(phases) - 1 >= 6
    assert env.startswith("== env: FAILED") and all("skipped: the environment phase failed" in line for line in rest)
    check_out_folder(out)
    assert seconds < 60


def test_prepare_carries_exactly_the_wheels_the_import_test_allows_and_the_image_lacks():
    from test_gpu_image_imports import CARRIED, IMAGE_LIST
    text = SCRIPT.read_text()
    body = text[text.index("prepare_wheels() {"):text.index("carried_bytes() {")]
    downloaded = set(re.findall(r'"([a-z0-9_-]+)>=[0-9.]+"', body))
    assert downloaded == CARRIED
    on_image = {line.strip().lower() for line in IMAGE_LIST.read_text().splitlines() if not line.startswith("#")}
    assert not downloaded & on_image          # carrying what the image has would install a second version
