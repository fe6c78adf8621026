"""Prompt text -> token ids for byte-level BPE tokenizers, without `tokenizers`' per-word cost.

`tokenizer.encode(text)` spends ~1 µs per word splitting the text (the regex pre-tokenizer
keeps offsets and alignments for every piece): 16-30 µs of a 16-word prompt, the largest part
of a request's server time on the mock engine. A byte-level BPE tokenizer encodes each piece
of the split on its own, so `PieceEncoder` splits with the tokenizer's own pattern and looks
each piece up in a bounded cache that the tokenizer itself fills, piece by piece, on first
sight. ASCII text (most prompts) is split by the stdlib `re` with the pattern's classes
spelled out for ASCII (`\\p{L}` -> `A-Za-z`, `\\p{N}` -> `0-9`, `\\s` -> the six ASCII
white-space characters of Unicode's White_Space): ~2 µs for 16 words; other text by the
`regex` module, which reads the pattern as the tokenizer does (~3x slower than `re`).

Contract: `piece_encoder(tokenizer)` -> a `PieceEncoder` whose `encode(text)` equals
`tokenizer.encode(text, add_special_tokens=False).ids`, or None when the tokenizer is not of
a shape this handles (then callers use `tokenizers`). Handled: a BPE model without dropout;
pre-tokenizer `ByteLevel(use_regex=True)` or `Sequence[Split(Regex, "Isolated"), ByteLevel
(use_regex=False)]`, no prefix space; no normalizer, or NFC (then only ASCII text takes the
fast path); no truncation or padding. Text holding an added token's content, or not handled
otherwise, goes to `tokenizers` whole.

Exactness is checked, not assumed: a piece enters the cache only if the tokenizer also sees
it as one piece; the first `VERIFY_FIRST` prompts, every prompt that brought a piece not seen
before, and every `VERIFY_EVERY`th prompt are encoded both ways and answered with the
tokenizer's ids; any difference turns the fast path off for good (logged). What is left
unchecked: a prompt made only of known pieces, between two samples, that the two regex
engines would cut differently (they implement the same pattern language; none is known).
"""

import json
import logging
import re

import regex

log = logging.getLogger("tokenwire.net")

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # ByteLevel(use_regex)
VERIFY_FIRST = 32
VERIFY_EVERY = 256
MAX_PIECES = 1 << 16            # cached pieces; the cache starts over when full (clients choose the text)


class PieceEncoder:
    """`encode(text)`: the tokenizer's ids, from cached pieces (see the module docstring)."""

    def __init__(self, tokenizer, pattern: str, isolated_gaps: bool, ascii_only: bool, added: list):
        self.tokenizer = tokenizer
        # Split(Isolated) also keeps the text between matches; ByteLevel's own regex covers everything
        self._split = _with_gaps(regex.compile(f"({pattern})")) if isolated_gaps else regex.compile(pattern).findall
        ascii_pattern = _ascii_pattern(pattern)
        if ascii_pattern is None:
            self._ascii_split = self._split
        else:
            self._ascii_split = (_with_gaps(re.compile(f"({ascii_pattern})")) if isolated_gaps
                                 else re.compile(ascii_pattern).findall)
        self._ascii_only = ascii_only
        self._added = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True))) if added else None
        self._cache: dict = {}
        self._count = 0
        self.enabled = True

    def encode(self, text: str) -> list:
        """Hot path: once per completion prompt."""
        if not self.enabled or (self._added is not None and self._added.search(text)):
            return self._slow(text)
        if text.isascii():
            split = self._ascii_split
        elif self._ascii_only:
            return self._slow(text)
        else:
            split = self._split
        cache = self._cache
        ids = []
        new_piece = False
        for piece in split(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._fill(piece)
                if piece_ids is None:
                    return self._slow(text)
                new_piece = True
            ids += piece_ids
        self._count += 1
        if new_piece or self._count <= VERIFY_FIRST or self._count % VERIFY_EVERY == 0:
            return self._verify(text, ids)
        return ids

    def _slow(self, text: str) -> list:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _fill(self, piece: str):
        """The piece's ids from the tokenizer, cached; None (and the fast path off) if the
        tokenizer would split it further: then our split is not its split."""
        if len(self.tokenizer.pre_tokenizer.pre_tokenize_str(piece)) != 1:
            self._disable(f"the piece {piece!r} is split further by the tokenizer")
            return None
        ids = self._slow(piece)
        if len(self._cache) >= MAX_PIECES:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def _verify(self, text: str, ids: list) -> list:
        expected = self._slow(text)
        if ids != expected:
            self._disable(f"the prompt {text[:80]!r} encodes differently")
        return expected

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            log.warning("fast prompt encoding is off (%s); every prompt goes through tokenizers", why)


def _with_gaps(wrapped):
    """A split function that returns matches and the text between them, never empty strings."""
    split = wrapped.split

    def pieces(text: str) -> list:
        return [p for p in split(text) if p]
    return pieces


_ASCII_SPACE = r" \t\n\x0b\x0c\r"      # Unicode White_Space within ASCII (Python's \s adds \x1c-\x1f)
_ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\s": _ASCII_SPACE}


def _ascii_pattern(pattern: str):
    """`pattern` for the stdlib `re`, exact on ASCII text only; None if it uses anything
    but literals, groups, quantifiers, classes and the escapes \\p{L} \\p{N} \\s \\S \\r \\n \\t."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = pattern[i:i + 5] if pattern.startswith(r"\p{", i) else pattern[i:i + 2]
            i += len(escape)
            if escape in _ASCII_CLASSES:
                spelled = _ASCII_CLASSES[escape]
                out.append(spelled if in_class else f"[{spelled}]")
            elif escape == r"\S" and not in_class:
                out.append(f"[^{_ASCII_SPACE}]")
            elif len(escape) == 2 and (escape[1] in "rnt" or not escape[1].isalnum()):
                out.append(escape)
            else:
                return None
            continue
        if c == "[":
            if in_class:
                return None         # nested classes / POSIX brackets: not spelled out here
            in_class = True
            if pattern.startswith("[^", i):
                out.append("[^")
                i += 2
                continue
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return None if in_class else "".join(out)


def piece_encoder(tokenizer):
    """A `PieceEncoder` for `tokenizer`, or None when its shape is not handled."""
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:           # not a tokenizers.Tokenizer
        return None
    shape = _shape(spec)
    if shape is None:
        return None
    pattern, isolated_gaps, ascii_only = shape
    try:
        compiled = regex.compile(pattern)
    except regex.error:
        return None
    if compiled.groups or compiled.fullmatch(""):   # capture groups would change split(); empty matches differ by engine
        return None
    added = [t["content"] for t in spec.get("added_tokens") or [] if t.get("content")]
    return PieceEncoder(tokenizer, pattern, isolated_gaps, ascii_only, added)


def _shape(spec: dict):
    """(pattern, isolated_gaps, ascii_only) for a handled tokenizer spec, else None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or spec.get("truncation") or spec.get("padding"):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN, False, normalizer is not None
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 2:
        split, byte_level = pre["pretokenizers"]
        if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                or "Regex" not in (split.get("pattern") or {})):
            return None
        if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space") or byte_level.get("use_regex"):
            return None
        return split["pattern"]["Regex"], True, normalizer is not None
    return None
