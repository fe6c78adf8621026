#!/usr/bin/env bash
# Build the single-file `tokenwire` binary (PyInstaller --onefile) into dist/tokenwire.
#
#   bash scripts/build_binary.sh            # -> dist/tokenwire (prints its size)
#   bash scripts/build_binary.sh OUT_DIR    # -> OUT_DIR/tokenwire
#
# What goes in: the package as pip installs it (the C kernels compiled by setup.py, the
# engine_build data files), every `tokenwire.*` submodule wholesale (the CLI imports its
# subcommands by name, so no static analysis can see them), and the runtime dependencies in
# pyproject.toml, from a venv of their own (build/binary-venv), with the package metadata of
# each of them and of what they require in turn (llguidance reads its own version with
# importlib.metadata at import; a binary without it died at start-up). What stays out: the test
# extras (torch, transformers, ...) and the peer frameworks `tokenwire bench peers` starts
# (FastAPI, hypercorn, uvicorn, grpc): that benchmark needs a Python with those installed;
# and hf_xet (11 MB unpacked, which every start pays for): huggingface_hub downloads over
# plain HTTP without it. The build ends by starting the binary (`serve --help` imports the
# whole serving path): a binary that cannot start fails the build.
# Needs: Python >= 3.10 with venv, a C compiler, PyPI (pip installs PyInstaller and the
# dependencies into the venv; later builds reuse it). Two builds in one checkout take turns
# (they share build/).
#
# Why PyInstaller and not Nuitka: docs/DEPLOY.md gives the measured size and start-up of both.
set -euo pipefail
unset PYTHONPATH PYTHONHOME        # a worktree's import path must not leak into the build
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$(realpath -m "${1:-dist}")
WORK=$REPO/build/binary
PY=${PYTHON:-python3}
VENV=$REPO/build/binary-venv
# Modules left out of the binary, by import name; their distributions' metadata stays out too,
# or huggingface_hub would find hf_xet's and then fail to import it.
EXCLUDED=(hf_xet)
mkdir -p "$REPO/build"
exec 9>"$REPO/build/binary.lock"
flock 9          # a second build in this checkout (another pytest run) waits for this one

# A venv of its own: only the runtime dependencies end up in the binary, and no editable
# install of another checkout (a .pth finder) can shadow this one's modules.
# A venv whose creation failed half-way (no ensurepip: Debian's python3-venv missing) has a
# python but no pip: made again rather than failing every later build.
"$VENV/bin/python" -c 'import pip' 2>/dev/null || { rm -rf "$VENV"; "$PY" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel 'pyinstaller>=6.0'
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
# The package exactly as pip installs it (tokenwire.core, tokenwire.kernels.cpu._cpu, ...)
"$VENV/bin/python" -m pip uninstall -q -y tokenwire 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-build-isolation "$REPO"    # and its runtime dependencies
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -n "$(ls "$site"/tokenwire/kernels/cpu/_cpu*.so 2>/dev/null)" ] \
  || { echo "build_binary: the C kernels did not compile (see the pip output above)" >&2; exit 1; }

# The binary unpacks itself at every start, so every byte costs start-up time: drop the debug
# sections of the extensions built from source here (uvloop's 13.6 MB -> 1.9 MB, the C kernels'
# 1.7 MB -> 0.25 MB). Not PyInstaller's --strip: it also strips numpy's bundled OpenBLAS, which
# then fails to load ("ELF load command address/offset not page-aligned", seen).
find "$site/uvloop" "$site/tokenwire" -name '*.so' -exec strip --strip-debug {} +

# Metadata (the .dist-info folders) of every runtime dependency: PyInstaller bundles a
# package's modules and libraries, but its metadata only when a hook asks for it. The list is
# read from the installed package (pyproject.toml's `dependencies`, markers evaluated, no
# extras) and followed through each dependency's own requirements, so a new one is covered.
metadata_args=$("$VENV/bin/python" - "${EXCLUDED[@]}" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
excluded = {canonicalize_name(name) for name in sys.argv[1:]}
todo, seen = ["tokenwire"], set()
while todo:
    name = canonicalize_name(todo.pop())
    if name in seen or name in excluded:
        continue
    seen.add(name)
    for req in map(Requirement, md.distribution(name).requires or []):
        if req.marker is None or req.marker.evaluate():
            todo.append(req.name)
print(" ".join(f"--copy-metadata {name}" for name in sorted(seen)))
EOF
)

# The entry point: the same function as the `tokenwire` console script.
printf 'import sys\nfrom tokenwire.cli import main\nsys.exit(main())\n' > "$WORK/entry.py"

cd "$WORK"       # the venv's tokenwire, not the repository folder
"$VENV/bin/python" -m PyInstaller --noconfirm --clean --onefile --name tokenwire \
  --distpath "$OUT" --workpath "$WORK/pyi" --specpath "$WORK" \
  --collect-submodules tokenwire --collect-data tokenwire --collect-binaries tokenwire \
  --collect-submodules uvloop ${EXCLUDED[@]/#/--exclude-module } $metadata_args \
  --log-level WARN "$WORK/entry.py"

"$OUT/tokenwire" serve --help >/dev/null \
  || { echo "build_binary: $OUT/tokenwire does not start (its traceback is above)" >&2; exit 1; }
echo "built $OUT/tokenwire: $(stat -c %s "$OUT/tokenwire") bytes"
