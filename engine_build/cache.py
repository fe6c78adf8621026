"""Where built engines are cached: `$TOKENWIRE_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenwire`,
else `~/.cache/tokenwire`; `cache_dir=` overrides all three. Engines live in `engines/`
below it (resolve.py for checkpoints, default_model.py for the embedded default).
"""

import os
from pathlib import Path


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("TOKENWIRE_CACHE_DIR"):
        return Path(os.environ["TOKENWIRE_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenwire"


def engines_dir(cache_dir=None) -> Path:
    return cache_root(cache_dir) / "engines"
