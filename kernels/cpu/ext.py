"""The C extension (`_cpu`, built by setup.py from kernels/cpu/src), or why it is missing.

Without a compiler at install time the package still imports: `AVAILABLE` is False,
`IMPORT_ERROR` says why, and kernels/cpu falls back to the numpy reference.
"""

from typing import Optional

try:
    from . import _cpu
    AVAILABLE = True
    IMPORT_ERROR: Optional[str] = None
except ImportError as exc:       # no compiler at install time: numpy reference only
    _cpu = None
    AVAILABLE = False
    IMPORT_ERROR = str(exc)

ISAS = ("scalar", "avx2", "avx512")
PRECISIONS = ("fp32", "int8")


def _require() -> None:
    if not AVAILABLE:
        raise RuntimeError(f"the tokenwire C kernels are not built ({IMPORT_ERROR})")
