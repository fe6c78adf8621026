"""The one exception engine_build raises for bad input.

Every message names the file (or hub name) and the problem, so the CLI prints one line
and exits 2 instead of a traceback from deep inside numpy or json.
"""

from pathlib import Path
from typing import Union


class BuildError(Exception):
    """A checkpoint, tokenizer or engine directory that cannot be used, and why."""

    def __init__(self, source: Union[str, Path, None], problem: str):
        self.source = None if source is None else str(source)
        self.problem = problem
        super().__init__(problem if source is None else f"{source}: {problem}")
