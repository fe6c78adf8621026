#!/usr/bin/env bash
# The README's test command: install what the tests need on a fresh Debian machine, then run them.
# Real clients the network tests drive: curl (HTTP/2), nghttp and h2load (nghttp2-client), Node.js;
# HAProxy for the replicas test (deploy/haproxy.cfg); for the single-file binary, which the suite
# builds once (scripts/build_binary.sh, about 2 minutes) and runs, python3-venv (its build venv,
# filled from PyPI) and binutils (strip, and PyInstaller's objdump). Arguments go to pytest:
# `bash scripts/test.sh -m "not binary"` leaves the binary out.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
need=()
command -v curl >/dev/null || need+=(curl)
command -v nghttp >/dev/null && command -v h2load >/dev/null || need+=(nghttp2-client)
command -v node >/dev/null || need+=(nodejs)
command -v cc >/dev/null || need+=(gcc)
command -v haproxy >/dev/null || need+=(haproxy)
command -v objdump >/dev/null && command -v strip >/dev/null || need+=(binutils)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# A C kernel that does not compile fails the install here (setup.py), instead of a warning
# that would leave the suite testing the numpy fallback.
TOKENWIRE_REQUIRE_C=1 python3 -m pip install -q -e '.[test]'
# pytest exits 5 when it collects nothing; that must fail CI, and it does (set -e).
# PYTHONSAFEPATH: `python -m` would put the repository root first on the import path, where
# its folders (core/, kernels/, net/, ...) shadow installed top-level packages of the same
# names (transformers probes a `kernels` package, for one); tokenwire is imported as installed.
PYTHONSAFEPATH=1 exec python3 -m pytest -q "$@"
