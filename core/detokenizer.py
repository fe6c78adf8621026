"""Token ids -> streamed text, one token at a time, with stop strings.

Contract:
- `Detokenizer(tokenizer)` is built once per HF `tokenizers.Tokenizer`; `stream(prompt_ids,
  params)` gives each request a text stream whose `push(token_id) -> str` returns the new
  text (possibly ""), whose `finish() -> str` returns what was held back, and whose
  `stopped` says a stop string was reached. `token_text(id)` is one token's text as it
  continues a text (what logprobs show), the server's one other use of the tokenizer's decoder.
- Text is held back while it ends in an incomplete UTF-8 sequence, and while its tail could
  be the start of a stop string; a stop string is never emitted, nor anything after it, and
  is found even when it spans several tokens (`TextStream.stopped` tells the scheduler).
- Cost is O(1) amortized per token, never re-decoding the sequence. Two decoders:
  * `ByteTableDecoder` (fast path): when the tokenizer's decoder is a concatenation of
    per-token bytes — byte-level BPE (GPT-2, Llama 3, Qwen2) or SentencePiece with "▁" and
    byte fallback (Llama 2, Mistral, Gemma, llama2.c vocabularies) — each id's bytes are
    tabulated once and checked against `tokenizer.decode` for every id (about 1 s for a
    150k vocabulary, at engine start); a token then costs one list lookup, plus a C UTF-8
    decode around characters split over tokens. One known difference: bytes that are not
    UTF-8 become one U+FFFD per maximal invalid subpart (the Unicode rule Python follows),
    where tokenizers' ByteFallback turns every byte of a broken run of byte tokens into
    U+FFFD, valid neighbours included. Valid text is identical.
  * `IncrementalDecoder` (any other tokenizer): the prefix/read-offset technique, calling
    `tokenizer.decode` on a window of at most `MAX_WINDOW + MAX_PENDING` ids.
- Generated text continues the prompt: a SentencePiece word's leading space is kept (the
  decoder strips the first space only at the start of a whole text — which is where a
  prompt that decodes to nothing, such as BOS alone, leaves it: `StartOfTextDecoder`).
"""

from codecs import utf_8_decode
import json
import logging
from typing import Optional, Sequence

from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
SPM_SPACE = "\u2581"                    # SentencePiece's "▁"


def byte_level_alphabet() -> dict:
    """GPT-2 byte-level BPE: the printable character standing for each byte. -> {char: byte}"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


# ------------------------------------------------------------------ per-token byte table

def decoder_kind(tokenizer) -> Optional[str]:
    """"byte_level", "sentencepiece", or None when the decoder is not a plain concatenation."""
    if tokenizer.decoder is None:
        return None
    spec = json.loads(tokenizer.decoder.__getstate__())
    if spec.get("type") == "ByteLevel":
        return "byte_level"
    if spec.get("type") == "Metaspace" and spec.get("replacement") == SPM_SPACE:
        return "sentencepiece"
    if spec.get("type") == "Sequence" and all(_is_spm_step(d) for d in spec.get("decoders", [])):
        return "sentencepiece"
    return None


def leading_spaces_stripped(tokenizer) -> int:
    """Spaces the decoder strips from the very start of a text (SentencePiece's dummy prefix)."""
    if tokenizer.decoder is None:
        return 0
    spec = json.loads(tokenizer.decoder.__getstate__())
    if spec.get("type") == "Metaspace":
        return 0 if spec.get("prepend_scheme") == "never" else 1
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else []
    return sum(d.get("start", 0) for d in steps if d.get("type") == "Strip")


def _is_spm_step(d: dict) -> bool:
    t = d.get("type")
    if t == "Replace":
        return d.get("pattern") == {"String": SPM_SPACE} and d.get("content") == " "
    if t == "Strip":
        return d.get("content") == " " and d.get("stop") == 0
    return t in ("ByteFallback", "Fuse")


def _piece_bytes(piece: str, kind: str, to_latin1: dict, alphabet_only: dict) -> bytes:
    if kind == "byte_level":
        if not piece.translate(alphabet_only):              # every char stands for a byte
            return piece.translate(to_latin1).encode("latin-1")
        return piece.encode()               # an added token outside the byte alphabet: as written
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SPM_SPACE, " ").encode()


def build_byte_tables(tokenizer) -> Optional[tuple]:
    """(bytes per id with special tokens skipped, bytes per id with them kept), each id as it
    continues a text; None when the tokenizer is not of a kind whose text is the
    concatenation of per-token bytes. Checked against tokenizer.decode for every id."""
    kind = decoder_kind(tokenizer)
    if kind is None:
        return None
    special = special_token_ids(tokenizer)
    byte_of = byte_level_alphabet()
    to_latin1 = {ord(c): b for c, b in byte_of.items()}    # str.translate tables: C speed over the vocabulary
    alphabet_only = dict.fromkeys(to_latin1)                # deletes the alphabet: "" means nothing else
    keep = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(i)
        keep.append(b"" if piece is None else _piece_bytes(piece, kind, to_latin1, alphabet_only))
    skip = [b"" if i in special else b for i, b in enumerate(keep)]
    anchor = next((i for i, b in enumerate(skip) if len(b) >= 2 and b.isalpha() and b.isascii()), None)
    if anchor is None:
        return None
    ok = _table_matches(tokenizer, skip, True, anchor, range(len(skip))) and \
        _table_matches(tokenizer, keep, False, anchor, sorted(special))      # only specials differ
    return (skip, keep) if ok else None


def _table_matches(tokenizer, table: list, skip_special_tokens: bool, anchor: int, ids) -> bool:
    """Each id decoded after the anchor (an ordinary word piece: a byte-fallback token would
    fuse with a following stray byte) adds exactly its tabulated bytes."""
    base = tokenizer.decode([anchor], skip_special_tokens=skip_special_tokens)
    texts = tokenizer.decode_batch([[anchor, i] for i in ids], skip_special_tokens=skip_special_tokens)
    for i, text in zip(ids, texts):
        if text != base + table[i].decode("utf-8", "replace"):
            log.info("detokenizer: id %d decodes to %r after the anchor, the byte table says %r; "
                     "using the generic incremental decoder", i, text[len(base):], table[i])
            return False
    return True


def special_token_ids(tokenizer) -> set:
    return {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


class ByteTableDecoder:
    """Fast path: per token, one list lookup; a C UTF-8 decode only around multi-byte
    characters split over tokens (their bytes wait in `pending`, at most 3)."""

    __slots__ = ("table", "text_table", "pending", "stopped")

    def __init__(self, table: list, text_table: list):
        self.table = table                  # list[bytes] per id
        self.text_table = text_table        # list[str | None] per id: None unless its bytes are whole UTF-8
        self.pending = b""                  # an incomplete UTF-8 sequence held back
        self.stopped = False                # a bare decoder never stops a request (see TextStream); a slot
                                            # rather than a class attribute: read once per token

    def push(self, token_id: int) -> str:
        """Hot path: once per generated token."""
        if not self.pending:
            try:
                text = self.text_table[token_id]
            except IndexError:              # ids the model has but the tokenizer lacks decode to nothing
                return ""
            if text is not None:
                return text
            buf = self.table[token_id]
        else:
            buf = self.pending + (self.table[token_id] if token_id < len(self.table) else b"")
        text, used = utf_8_decode(buf, "replace", False)
        self.pending = buf[used:]
        return text

    def finish(self) -> str:
        text, self.pending = self.pending.decode("utf-8", "replace"), b""
        return text


class StartOfTextDecoder:
    """Wraps a decoder for a prompt that decodes to no text (e.g. BOS alone): the generated
    text is then the start of the text, and loses the spaces the tokenizer's decoder strips there."""

    __slots__ = ("decoder", "strip")
    stopped = False

    def __init__(self, decoder, strip: int):
        self.decoder = decoder
        self.strip = strip

    def push(self, token_id: int) -> str:
        return self._strip(self.decoder.push(token_id))

    def finish(self) -> str:
        return self._strip(self.decoder.finish())

    def _strip(self, text: str) -> str:
        while self.strip and text:
            if text[0] == " ":
                text = text[1:]
                self.strip -= 1
            else:
                self.strip = 0
        return text


def text_table(table: list) -> list:
    """str of every id whose bytes are complete UTF-8 on their own, else None."""
    out = []
    for b in table:
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
    return out


# ------------------------------------------------------------------ generic decoder

class IncrementalDecoder:
    """Any tokenizer: decode a short window of ids and emit what grew past the window's prefix.

    `ids[prefix_offset:read_offset]` decoded is `prefix_text`, text already emitted; each push
    decodes `ids[prefix_offset:]`. Every few tokens the window is re-anchored (one extra
    decode) to a recent character boundary — a point where the emitted text was complete —
    because a window starting inside a multi-byte character decodes differently (byte
    fallback turns a whole broken run into U+FFFD). Pending ids are capped and skipped special
    tokens never enter the window, so a token costs about 1.25 decode calls over at most
    MAX_WINDOW + MAX_PENDING ids, whatever the stream.
    """

    MAX_PENDING = 6     # ids held while the text ends in U+FFFD (a UTF-8 character is at most 4 bytes)
    MAX_WINDOW = 8      # re-anchor once the emitted part of the window is longer ...
    KEEP = 4            # ... keeping about this many ids of context (SentencePiece spaces, merges)

    __slots__ = ("tokenizer", "skip_special_tokens", "special_ids", "ids", "prefix_offset",
                 "read_offset", "prefix_text", "boundaries")
    stopped = False

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool, special_ids: set):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = special_ids if skip_special_tokens else frozenset()
        tail = [i for i in prompt_ids[-self.KEEP * 2:] if i not in self.special_ids]
        start = max(0, len(tail) - self.KEEP)
        while start > 0 and REPLACEMENT in tokenizer.decode(tail[start:start + 1], skip_special_tokens=False):
            start -= 1                       # begin the context on a whole character
        self.ids = tail[start:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(0, self.read_offset)
        self.boundaries = [self.read_offset] if not self.prefix_text.endswith(REPLACEMENT) else []

    def _decode(self, start: int, stop: Optional[int] = None) -> str:
        return self.tokenizer.decode(self.ids[start:stop], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Hot path: once per generated token."""
        if token_id in self.special_ids:
            return ""
        self.ids.append(token_id)
        text = self._decode(self.prefix_offset)
        if text.endswith(REPLACEMENT) and len(self.ids) - self.read_offset < self.MAX_PENDING:
            return ""                        # an incomplete UTF-8 character: wait for its next byte
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self.prefix_text):]
        self.read_offset = len(self.ids)
        self.prefix_text = text
        if not text.endswith(REPLACEMENT):
            self.boundaries.append(self.read_offset)
        if self.read_offset - self.prefix_offset > self.MAX_WINDOW:
            self._reanchor()
        return delta

    def _reanchor(self) -> None:
        """Move the window start to the boundary nearest KEEP ids back (or KEEP ids back when a
        run of broken bytes left none within MAX_WINDOW)."""
        read, target = self.read_offset, self.read_offset - self.KEEP
        near = [b for b in self.boundaries if read - self.MAX_WINDOW < b < read]
        start = max((b for b in near if b <= target), default=min(near, default=target))
        self.boundaries = [b for b in self.boundaries if b > start]
        self.prefix_offset = start
        self.prefix_text = self._decode(start, read)
        if start > 1024:                     # drop ids no window will see again
            del self.ids[:start]
            self.read_offset -= start
            self.prefix_offset = 0
            self.boundaries = [b - start for b in self.boundaries]

    def finish(self) -> str:
        if len(self.ids) == self.read_offset:
            return ""
        return self._emit(self._decode(self.prefix_offset))


# ------------------------------------------------------------------ stop strings

class StopStringMatcher:
    """Cuts the text at the first stop string to complete, across pushes; holds back only a
    tail that could still grow into one. "First to complete" (earliest end, then earliest
    start) makes the cut independent of how the text was split into pushes."""

    __slots__ = ("stops", "max_hold", "pending", "stopped")

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.max_hold = max(len(s) for s in self.stops) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if not text:
            return ""
        buf = self.pending + text
        hits = [(i + len(s), i) for s, i in zip(self.stops, map(buf.find, self.stops)) if i >= 0]
        if hits:                            # the stop completed first wins, as it would token by token
            self.stopped = True
            self.pending = ""
            return buf[:min(hits)[1]]
        hold = self._partial_match_len(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for n in range(min(self.max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """A decoder with stop strings. (A request without stop strings uses its decoder
    directly: the same push / finish / stopped interface, one call less per token.)"""

    __slots__ = ("decoder", "matcher")

    def __init__(self, decoder, matcher: StopStringMatcher):
        self.decoder = decoder
        self.matcher = matcher

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, token_id: int) -> str:
        """Hot path: once per generated token."""
        return self.matcher.push(self.decoder.push(token_id))

    def finish(self) -> str:
        """Everything held back, at the end of the request (nothing after a stop string)."""
        if self.matcher.stopped:
            return ""
        text = self.matcher.push(self.decoder.finish())
        return text if self.matcher.stopped else text + self.matcher.flush()


class MinTokensTextStream(TextStream):
    """A TextStream whose stop strings apply from the request's `min_tokens`-th token on
    (vLLM's rule); the text of earlier tokens never reaches the matcher."""

    __slots__ = ("num_unarmed",)

    def __init__(self, decoder, matcher: StopStringMatcher, min_tokens: int):
        super().__init__(decoder, matcher)
        self.num_unarmed = min_tokens - 1       # tokens whose text passes the matcher by

    def push(self, token_id: int) -> str:
        """Hot path: once per generated token."""
        if self.num_unarmed > 0:
            self.num_unarmed -= 1
            return self.decoder.push(token_id)
        return self.matcher.push(self.decoder.push(token_id))


class Detokenizer:
    """Per-tokenizer tables, built once; hands each request its text stream."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self.leading_strip = leading_spaces_stripped(tokenizer)
        tables = build_byte_tables(tokenizer)           # both now: never on a request's path
        # skip_special_tokens -> (bytes per id, str per id) or None (generic decoder)
        self._tables = {True: None, False: None} if tables is None else \
            {skip: (table, text_table(table)) for skip, table in zip((True, False), tables)}
        self._token_texts = {}                          # token id -> token_text(id)
        self._anchor_id = None                          # the id token_text continues ("a")

    def byte_table(self, skip_special_tokens: bool) -> Optional[tuple]:
        return self._tables[skip_special_tokens]

    def token_text(self, token_id: int) -> str:
        """One token's text as it continues a text (logprobs), e.g. " there", not the
        start-of-text form "there" a lone decode gives for SentencePiece pieces. Cached:
        logprobs ask for the same few thousand ids again and again (the dict is only added
        to, so the loop thread may call this while the engine thread streams)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.tokenizer
            if self._anchor_id is None:
                self._anchor_id = tokenizer.encode("a", add_special_tokens=False).ids[-1]
            base = tokenizer.decode([self._anchor_id], skip_special_tokens=False)
            both = tokenizer.decode([self._anchor_id, token_id], skip_special_tokens=False)
            text = both[len(base):] if both.startswith(base) else tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def decoder(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        tables = self.byte_table(skip_special_tokens)
        if tables is None:
            return IncrementalDecoder(self.tokenizer, prompt_ids, skip_special_tokens, self.special_ids)
        decoder = ByteTableDecoder(*tables)
        if self.leading_strip and not any(tables[0][i] for i in prompt_ids if i < len(tables[0])):
            return StartOfTextDecoder(decoder, self.leading_strip)
        return decoder

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams):
        """-> an object with push(token_id) -> str, finish() -> str and .stopped"""
        decoder = self.decoder(prompt_ids, params.skip_special_tokens)
        if not params.stop:
            return decoder
        if params.min_tokens > 1:
            return MinTokensTextStream(decoder, StopStringMatcher(params.stop), params.min_tokens)
        return TextStream(decoder, StopStringMatcher(params.stop))
