"""Build tokenwire: one import namespace over the repository's top-level folders, plus five C
extensions: the CPU kernels (kernels/cpu/src), the per-step HTTP/2 DATA framing
(net/protocol/_frames.c), the common case of the per-row loops of the scheduler
(core/_rows.c) and of the step writer (net/writer/_columns.c), and a CUDA kernel launch in one
C call (kernels/cuda/_launch.c: libcuda is looked up at run time, so it builds without CUDA).

The repository keeps the design's layout (core/, kernels/, net/, engine_build/, bench/);
`package_dir` maps each folder onto `tokenwire.<folder>`, so site-packages gets one
`tokenwire` package and no generic top-level names.

The C extensions are optional at install time: with no working compiler the install still
succeeds and tokenwire falls back to the numpy reference kernels, printing one warning
when the CPU backend starts, to the same framing in Python (net/protocol/frames.py), to
the Python loop bodies (core/scheduler.py, net/writer/dispatch.py), and to the launch through
ctypes (kernels/cuda/driver.py NativeLaunch).
With TOKENWIRE_REQUIRE_C=1 in the environment (CI sets it, in scripts/test.sh) an extension
that fails to compile fails the install instead, loudly.
"""

import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.extension import Extension

HERE = os.path.dirname(os.path.abspath(__file__))
TOP_LEVEL = ["core", "kernels", "net", "engine_build", "bench"]


def namespace_packages():
    """Map `tokenwire.<folder>[.sub]` onto the repository folders."""
    package_dir = {"tokenwire": "tokenwire"}
    packages = ["tokenwire"] + [f"tokenwire.{p}" for p in find_packages("tokenwire")]
    for top in TOP_LEVEL:
        package_dir[f"tokenwire.{top}"] = top
        packages.append(f"tokenwire.{top}")
        for sub in find_packages(top):
            packages.append(f"tokenwire.{top}.{sub}")
    return packages, package_dir


def cpu_kernel_sources(suffix=".c"):
    src = os.path.join("kernels", "cpu", "src")
    if not os.path.isdir(os.path.join(HERE, src)):
        return []
    return sorted(os.path.join(src, f) for f in os.listdir(os.path.join(HERE, src)) if f.endswith(suffix))


class RequiredBuildFailed(RuntimeError):
    pass


class OptionalBuildExt(build_ext):
    """Build the C extensions when a compiler works; otherwise warn and install without them
    (or fail, with TOKENWIRE_REQUIRE_C=1)."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all: distutils raises before building
            self._fail_or_warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fail_or_warn(exc)

    @staticmethod
    def _fail_or_warn(exc):
        if isinstance(exc, RequiredBuildFailed):
            raise exc
        if os.environ.get("TOKENWIRE_REQUIRE_C") == "1":
            raise RequiredBuildFailed(f"a tokenwire C extension failed to build and TOKENWIRE_REQUIRE_C=1: {exc}") \
                from exc
        print(f"WARNING: a tokenwire C extension was not built ({exc}); its Python fallback will be used "
              "(the numpy reference kernels, net/protocol/frames.py, or the Python loop bodies).", file=sys.stderr)


def extensions():
    # the per-step DATA framing: plain C, no intrinsics (net/protocol/frames.py is its twin)
    # and the per-row loops of the scheduler and the step writer: plain C on Python objects (core/scheduler.py
    # and net/writer/dispatch.py keep the Python bodies, which take every row the C leaves)
    plain = ["-O2", "-std=c11", "-fvisibility=hidden"]
    slots = dict(include_dirs=["core"], depends=[os.path.join("core", "_slots.h")], extra_compile_args=plain)
    exts = [Extension("tokenwire.net.protocol._frames", sources=[os.path.join("net", "protocol", "_frames.c")], **slots),
            Extension("tokenwire.core._rows", sources=[os.path.join("core", "_rows.c")], **slots),
            Extension("tokenwire.net.writer._columns", sources=[os.path.join("net", "writer", "_columns.c")], **slots),
            # a CUDA kernel launch in one C call (libcuda found at run time: no CUDA needed to build)
            Extension("tokenwire.kernels.cuda._launch", sources=[os.path.join("kernels", "cuda", "_launch.c")],
                      extra_compile_args=plain, extra_link_args=["-ldl"])]
    sources = cpu_kernel_sources()
    if not sources:
        return exts
    # No -march=native: the wheel must run on any x86-64. AVX2/AVX-512 paths are compiled
    # per function with target attributes and chosen at run time (kernels/cpu/src/dispatch.c).
    args = ["-O3", "-std=c11", "-fno-strict-aliasing", "-fvisibility=hidden", "-pthread"]
    # depends: the headers, so a source distribution carries them and edits trigger a rebuild
    return exts + [Extension("tokenwire.kernels.cpu._cpu", sources=sources, depends=cpu_kernel_sources(".h"),
                             include_dirs=[os.path.join("kernels", "cpu", "src")],
                             extra_compile_args=args, extra_link_args=["-pthread", "-lm"])]


packages, package_dir = namespace_packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "tokenwire.kernels": ["cuda/*.cu", "cuda/*.cuh", "cuda/*.h"],
        "tokenwire.engine_build": ["data/*.txt"],
        "tokenwire.net.api": ["proto/*.proto", "proto/*.binpb"],
        "tokenwire.bench": ["peers/*.proto",       # the grpc.aio peer compiles it at run time
                            "cclient/*.c",         # the C load client, compiled on first use (fast_client.py)
                            "node/*.mjs"],         # the Node load client
    },
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
