"""Hub names (`org/name`): download the files a build needs with huggingface_hub.

Only what the Hugging Face importer reads is fetched (config, safetensors weights and
index, tokenizer files, chat template). The files land in huggingface_hub's own cache, so a
second build, or an offline machine (HF_HUB_OFFLINE=1) that downloaded before, reuses them.
Any failure — no network, unknown repository, gated model — is one BuildError naming the repo.
"""

import re
from pathlib import Path

from huggingface_hub import snapshot_download

from ..core.errors import BuildError

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "chat_template.jinja", "chat_template.json"]


def looks_like_hub_name(spec: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(HUB_NAME.fullmatch(spec)) and not Path(spec).exists()


def download(repo_id: str, revision: str = None) -> Path:
    """-> local snapshot directory of `repo_id` holding the files a build reads."""
    try:
        local = snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except Exception as exc:  # network errors, 401/404, offline mode: all surface as one clear message
        raise BuildError(repo_id, f"cannot download from the Hugging Face hub: {type(exc).__name__}: "
                                  f"{_first_line(exc)}") from None
    return Path(local)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
