"""SentencePiece-BPE vocabularies -> one Hugging Face `tokenizer.json`.

tokenwire has one tokenizer path (HF `tokenizers`), so llama2.c vocabularies are converted:
- llama2.c's `tok*.bin`: int32 max_token_length, then per id: float32 score, int32 len, bytes
  (a real space instead of `▁`; BOS stored as "\\n<s>\\n", EOS as "\\n</s>\\n");
- a SentencePiece `.model` (ModelProto), read here with a tiny protobuf wire-format reader, so
  neither sentencepiece nor protobuf is needed at run time.

The tokenizer.json reproduces llama2.c's `run.c` encode(): one dummy-prefix space before any
non-empty text, spaces as `▁`, BPE merging the highest-scored pair first, characters missing
from the vocabulary as `<0xNN>` byte tokens. Merges are derived from the scores: every split
of a piece into two vocabulary pieces is a merge, ranked by the piece's score. No whitespace
pre-splitting and no whitespace collapsing (run.c does neither; sentencepiece's own
`remove_extra_whitespaces` does, so the two differ only on runs of spaces).

BOS: the post-processor prepends `<s>` when `add_special_tokens=True`; the engine's prompt rule
(`add_bos_token: true` in tokenizer_config.json) does the same, as run.c does for every prompt.
Decoding maps `▁` back to spaces, byte tokens back to bytes, and drops the dummy prefix.
"""

import re
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from ..core.errors import BuildError

# SentencePiece piece types (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_BPE = 2
SPACE = "\u2581"                       # ▁
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass
class Vocab:
    pieces: list                        # id -> piece text, spaces as ▁
    scores: list                        # id -> float, higher merges first
    types: list                         # id -> NORMAL | UNKNOWN | CONTROL | USER_DEFINED | UNUSED | BYTE
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


# ---- readers ----------------------------------------------------------------------------

def read_llama2c_vocab(path, vocab_size: int = None) -> Vocab:
    """llama2.c tokenizer .bin -> Vocab. `vocab_size` defaults to reading entries until the end."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise BuildError(path, f"truncated llama2.c tokenizer: {len(data)} bytes")
    pieces, scores, pos = [], [], 4
    while pos < len(data) and (vocab_size is None or len(pieces) < vocab_size):
        if pos + 8 > len(data):
            raise BuildError(path, f"truncated llama2.c tokenizer: entry {len(pieces)} header cut at byte {pos}")
        score, length = struct.unpack_from("<fi", data, pos)
        if length < 0 or pos + 8 + length > len(data):
            raise BuildError(path, f"corrupt llama2.c tokenizer: entry {len(pieces)} claims {length} bytes at byte {pos}")
        text = _utf8(path, data[pos + 8:pos + 8 + length], len(pieces))
        pieces.append(text)
        scores.append(score)
        pos += 8 + length
    if vocab_size is not None and len(pieces) < vocab_size:
        raise BuildError(path, f"llama2.c tokenizer has {len(pieces)} entries, the checkpoint needs {vocab_size}")
    return _classify_llama2c(pieces, scores)


def _utf8(path, raw: bytes, index: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BuildError(path, f"corrupt llama2.c tokenizer: entry {index} is not UTF-8 ({raw!r})") from None


def _classify_llama2c(texts: list, scores: list) -> Vocab:
    """Restore piece types from llama2.c's flattened strings (export wrote BOS/EOS as "\\n<s>\\n")."""
    pieces, types, bos_id, eos_id = [], [], 1, 2
    for i, text in enumerate(texts):
        if text == "\n<s>\n":
            pieces.append("<s>"), types.append(CONTROL)
            bos_id = i
        elif text == "\n</s>\n":
            pieces.append("</s>"), types.append(CONTROL)
            eos_id = i
        elif text == "<unk>":
            pieces.append(text), types.append(UNKNOWN)
        elif BYTE_PIECE.fullmatch(text):
            pieces.append(text), types.append(BYTE)
        else:
            pieces.append(text.replace(" ", SPACE)), types.append(NORMAL)
    unk_id = types.index(UNKNOWN) if UNKNOWN in types else 0
    return Vocab(pieces, list(scores), types, unk_id, bos_id, eos_id)


def read_sentencepiece_model(path) -> Vocab:
    """SentencePiece ModelProto -> Vocab (BPE models only)."""
    path = Path(path)
    fields = _proto_fields(path, _read_bytes(path))
    pieces, scores, types = [], [], []
    for number, value in fields:
        if number == 1:
            piece = dict(_proto_fields(path, value))
            pieces.append(_utf8(path, piece.get(1, b""), len(pieces)))
            scores.append(struct.unpack("<f", struct.pack("<I", piece.get(2, 0)))[0])
            types.append(piece.get(3, NORMAL))
    if not pieces:
        raise BuildError(path, "not a SentencePiece model: no pieces found")
    trainer = dict(_proto_fields(path, dict(fields).get(2, b"")))
    if trainer.get(3, 1) != SPM_BPE:
        raise BuildError(path, f"SentencePiece model_type {trainer.get(3, 1)} is not supported (only BPE, type 2)")
    ids = {k: _signed(trainer.get(n, d)) for k, n, d in (("unk", 40, 0), ("bos", 41, 1), ("eos", 42, 2))}
    return Vocab(pieces, scores, types, ids["unk"], ids["bos"], ids["eos"])


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BuildError(path, f"cannot read tokenizer: {exc.strerror or exc}") from None


def _signed(v: int) -> int:
    """protobuf int32 fields are varints in two's complement over 64 bits (-1 -> 2**64 - 1)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _proto_fields(path, data: bytes) -> list:
    """Protobuf wire format -> [(field number, int | bytes)]; fixed32 as its uint32 bits."""
    out, pos = [], 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(data, pos)
            elif wire == 2:
                length, pos = _varint(data, pos)
                value, pos = data[pos:pos + length], pos + length
                if pos > len(data):
                    raise IndexError
            elif wire == 5:
                value, pos = struct.unpack_from("<I", data, pos)[0], pos + 4
            elif wire == 1:
                value, pos = struct.unpack_from("<Q", data, pos)[0], pos + 8
            else:
                raise ValueError(f"wire type {wire}")
            out.append((number, value))
    except (IndexError, ValueError, struct.error) as exc:
        raise BuildError(path, f"corrupt SentencePiece model: bad protobuf at byte {pos} ({exc or 'truncated'})") from None
    return out


def _varint(data: bytes, pos: int) -> tuple:
    result, shift = 0, 0
    while True:
        b = data[pos]
        result |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


# ---- Vocab -> tokenizer.json --------------------------------------------------------------

def bpe_merges(vocab: Vocab) -> list:
    """Every split of a normal piece into two normal pieces, best-scored piece first."""
    mergeable = {p: i for i, (p, t) in enumerate(zip(vocab.pieces, vocab.types)) if t in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                ranked.append((-vocab.scores[i], i, mergeable[left], (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def vocab_to_tokenizer(vocab: Vocab):
    """Vocab -> tokenizers.Tokenizer with run.c's encode and decode (see the module docstring)."""
    byte_fallback = BYTE in vocab.types
    model = models.BPE(vocab={p: i for i, p in enumerate(vocab.pieces)}, merges=bpe_merges(vocab),
                       unk_token=vocab.pieces[vocab.unk_id], byte_fallback=byte_fallback, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = [vocab.pieces[i] for i, t in enumerate(vocab.types) if t in (CONTROL, UNKNOWN)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos = vocab.pieces[vocab.bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab.bos_id)])
    return tok


def tokenizer_config(vocab: Vocab, max_length: int = None) -> dict:
    """tokenizer_config.json for a converted vocabulary: BOS on every prompt, as run.c does."""
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": vocab.pieces[vocab.bos_id],
              "eos_token": vocab.pieces[vocab.eos_id], "unk_token": vocab.pieces[vocab.unk_id],
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": None}
    if max_length:
        config["model_max_length"] = max_length
    return config


def sentencepiece_model_to_tokenizer_json(path) -> bytes:
    return vocab_to_tokenizer(read_sentencepiece_model(path)).to_str().encode()


def read_any_vocab(path, vocab_size: int = None) -> Vocab:
    """A SentencePiece `.model` or a llama2.c vocabulary (`.bin`, or anything else)."""
    path = Path(path)
    if not path.is_file():
        raise BuildError(path, "missing tokenizer file")
    if path.suffix == ".model":
        return read_sentencepiece_model(path)
    return read_llama2c_vocab(path, vocab_size)
