"""The CUDA kernels compile, and host and device agree on every kernel's arguments (CPU only).

- nvcc (when present) builds every kernel for sm_90 and for sm_75 (the oldest target: the
  tensor-core paths must compile out cleanly), with no register spills on sm_90.
- The PTX entry points match kernels/cuda/kernels.py parameter for parameter, so a kernel
  whose signature changes without the host table fails here, not on a GPU.
- NVRTC (cuda-python, when installed) compiles the same translation unit.
- The on-disk cache is keyed by source hash and architecture.
"""

import re
import subprocess

import pytest

from tokenwire.kernels.cuda import build
from tokenwire.kernels.cuda.kernels import SPECS

PTX_TYPES = {"p": {".u64", ".b64", ".s64"}, "i": {".u32", ".s32", ".b32"}, "f": {".f32"}}
# nvcc builds every kernel for two targets and the PTX, three runs side by side: about 2 minutes
# on two idle cores, 5 on a busy shared machine, past the suite's 300 s per test
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def nvcc_log(tmp_path_factory):
    """nvcc's sm_90 and sm_75 builds with ptxas statistics, and the compute_90 PTX."""
    nvcc = build.nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    tmp = tmp_path_factory.mktemp("nvcc")
    src = tmp / "bundle.cu"
    src.write_text(build.bundle_source())
    common = [nvcc, *build.FLAGS, "-I", str(build.SOURCE_DIR)]
    # three nvcc runs side by side (one per core; in one run the targets compile one after another)
    runs = {arch: subprocess.Popen(common + ["-fatbin", "-O3", "-Xptxas", "-v", "-gencode",
                                             f"arch=compute_{arch[3:]},code={arch}", "-o", str(tmp / f"{arch}.fatbin"),
                                             str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for arch in ("sm_90", "sm_75")}
    runs["ptx"] = subprocess.Popen(common + ["-ptx", "-arch=compute_90", "-o", str(tmp / "k.ptx"), str(src)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = {name: run.communicate(timeout=900)[1] for name, run in runs.items()}
    for name, run in runs.items():
        assert run.returncode == 0, f"nvcc ({name}) failed:\n{logs[name][-4000:]}"
    return logs["sm_90"] + logs["sm_75"], (tmp / "k.ptx").read_text()


def ptxas_stats(log: str) -> dict:
    """(kernel, arch) -> {"spill": bytes spilled, "registers": n} from `ptxas -v` output."""
    stats, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            stats[current] = {}
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            stats[current]["spill"] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            stats[current]["registers"] = int(m.group(1))
    return stats


def ptx_entries(ptx: str) -> dict:
    """kernel name -> [PTX parameter types] for every .entry."""
    entries = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        entries[m.group(1)] = re.findall(r"\.param\s+(\.\w+)", m.group(2))
    return entries


def test_every_kernel_compiles_for_sm90_and_sm75(nvcc_log):
    stats = ptxas_stats(nvcc_log[0])
    for arch in ("sm_90", "sm_75"):
        missing = sorted(set(SPECS) - {k for k, a in stats if a == arch})
        assert not missing, f"kernels absent from the {arch} build: {missing}"


def test_no_register_spills_on_sm90(nvcc_log):
    stats = ptxas_stats(nvcc_log[0])
    sm90 = {k: s for (k, a), s in stats.items() if a == "sm_90"}
    unread = sorted(set(SPECS) - {k for k, s in sm90.items() if "spill" in s})
    assert not unread, f"no spill figures read from ptxas for: {unread}"     # else the check below sees nothing
    spilled = {k: s for k, s in sm90.items() if s["spill"]}
    assert not spilled, f"sm_90 kernels spilling to local memory: {spilled}"
    # 1024-thread kernels must fit 64 registers per thread or they cannot launch
    for name in ("argmax_rows", "sample_tokens", "compute_logprobs"):
        assert stats[(name, "sm_90")]["registers"] <= 64, (name, stats[(name, "sm_90")])


def check_signatures(ptx: str) -> None:
    entries = ptx_entries(ptx)
    assert set(entries) == set(SPECS), (f"PTX entries and kernels.py differ: only in PTX {sorted(set(entries) - set(SPECS))}, "
                                        f"only in kernels.py {sorted(set(SPECS) - set(entries))}")
    for name, spec in SPECS.items():
        types = entries[name]
        assert len(types) == len(spec.param_types), f"{name}: {len(types)} parameters in PTX, {len(spec.param_types)} in kernels.py"
        for i, (ptx_type, code) in enumerate(zip(types, spec.param_types)):
            assert ptx_type in PTX_TYPES[code], f"{name} parameter {i} ({spec.param_names[i]}): PTX {ptx_type}, host {code!r}"


def test_ptx_signatures_match_the_host_table(nvcc_log):
    check_signatures(nvcc_log[1])


def test_nvrtc_compiles_the_same_sources():
    if not build.nvrtc_available():
        pytest.skip("cuda-python's NVRTC is not installed")
    ptx = build.compile_nvrtc("sm_90", ptx=True).decode()
    assert ".target sm_90" in ptx
    check_signatures(ptx)
    if build.nvcc_path() is None:            # no nvcc test above: let NVRTC's own ptxas build the cubin
        assert build.compile_nvrtc("sm_90")[:4] == b"\x7fELF"


def test_cache_is_keyed_by_sources_and_arch(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(arch, compiler="auto"):
        compiled.append(arch)
        return f"cubin for {arch}".encode(), "test"
    monkeypatch.setattr(build, "compile_image", fake_compile)
    assert build.kernel_image("sm_90", tmp_path) == b"cubin for sm_90"
    assert build.kernel_image("sm_90", tmp_path) == b"cubin for sm_90"      # from the cache
    assert compiled == ["sm_90"]
    build.kernel_image("sm_80", tmp_path)
    assert compiled == ["sm_90", "sm_80"]
    sources = build.read_sources()
    edited = dict(sources, **{"rmsnorm.cu": sources["rmsnorm.cu"] + "\n// edited\n"})
    assert build.cache_key("sm_90", edited) != build.cache_key("sm_90", sources)
    assert build.cache_key("sm_90") != build.cache_key("sm_80")


def test_bad_arch_is_named():
    with pytest.raises(ValueError, match="sm_90"):
        build.cache_key("hopper")
