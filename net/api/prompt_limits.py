"""A prompt's size before it is tokenized, and where large prompts are tokenized.

The loop must never do unbounded work for one request. Two rules:

1. A prompt that cannot fit the context is refused from its byte length alone, before any
   tokenizing, where the length gives an exact bound: no token covers more than
   `max_token_bytes` bytes of the prompt, so a prompt of B bytes has at least
   ceil(B / max_token_bytes) tokens. (bytes >= tokens is not true of every tokenizer: a
   token of a BPE vocabulary covers up to its own length.) The bound is exact for BPE
   models that never fall back to an unknown token (byte-level BPE, or SentencePiece BPE with
   byte fallback: every input byte has a token) under a normalizer that never shortens text
   (none, Prepend, or Replace by something at least as long); a vocabulary token's own UTF-8
   length is then at least the bytes it covers (byte-level symbols are 1-2 bytes per byte,
   `▁` is 3 for a space, `<0x41>` 6 for one byte). Anything else (WordPiece or Unigram whose
   `[UNK]` covers a whole word, NFC/NFKC/lowercasing, which can shorten) gets no byte bound:
   `max_token_bytes` is None.
2. A prompt of `LARGE_PROMPT_CHARS` or more is tokenized on a worker thread through
   `tokenizers`' batch path (which releases the GIL), so it costs its own request's time,
   not every client's. There are TOKENIZE_WORKERS of them (at least two): with one, a
   prompt of a few MB (about a second of tokenizing) held every large prompt behind it.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

LARGE_PROMPT_CHARS = 16 * 1024          # from this length on a prompt is tokenized off the loop (~1 ms of work)
# the CPUs this process may use (os.cpu_count() where there is no affinity call), 2 to 4
TOKENIZE_WORKERS = max(2, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def max_token_bytes(tokenizer) -> int | None:
    """The most prompt bytes one token can cover, or None where no exact bound exists (see rule 1)."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and not model.get("byte_fallback")):
        return None
    if not _never_shortens(spec.get("normalizer")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


def _never_shortens(normalizer) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_shortens(n) for n in normalizer.get("normalizers", ()))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        return pattern is not None and len(normalizer.get("content", "").encode()) >= len(pattern.encode())
    return False


def min_prompt_tokens(text: str, token_bytes: int) -> int:
    """At least this many tokens encode `text` (rule 1); O(1) for ASCII text."""
    num_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-num_bytes // token_bytes)


class Tokenizing:
    """The worker threads that tokenize large prompts (rule 2); `submit` -> a Future of the ids."""

    def __init__(self, tokenizer, num_workers: int = TOKENIZE_WORKERS):
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="tokenwire-tokenize")

    def submit(self, text: str, prefix: list):
        return self._pool.submit(self._encode, text, prefix)

    def _encode(self, text: str, prefix: list) -> list:
        return prefix + self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
