"""A GGUF file's tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) -> tokenizer.json.

Two styles, by `tokenizer.ggml.model`:
- "llama": a SentencePiece BPE vocabulary (tokens, scores, token types) -> tokenizer_convert's
  Vocab, converted the way llama2.c and SentencePiece `.model` files are (dummy-prefix space,
  `▁` for spaces, highest-score merge first, `<0xNN>` byte fallback): what llama.cpp's SPM
  tokenizer does; USER_DEFINED pieces are matched whole, and `add_space_prefix: false` drops
  the dummy prefix.
- "gpt2": byte-level BPE (tokens in GPT-2's byte-to-unicode alphabet, `tokenizer.ggml.merges`),
  split first by the pre-tokenizer regex `tokenizer.ggml.pre` names (SPLIT_PATTERNS).
Token types are SentencePiece's (CONTROL tokens become special added tokens, USER_DEFINED ones
plain added tokens). BOS is added to prompts when `tokenizer.ggml.add_bos_token` says so
(default: true for "llama", false for "gpt2", as llama.cpp does). Generation stops at EOS and
at `eot_token_id` / `eom_token_id` when the file names them.
"""

import json
from dataclasses import replace
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..core.config import ModelConfig
from ..core.errors import BuildError
from .source import make_tokenizer_files
from .tokenizer_convert import CONTROL, SPACE, UNKNOWN, USER_DEFINED, Vocab, vocab_to_tokenizer

# tokenizer.ggml.pre -> the split regex of the original tokenizer.json (facts from those files)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SPLIT_PATTERNS = {"default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "smaug-bpe": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
ADD_BOS_DEFAULT = {"llama": True, "gpt2": False}


def read_gguf_tokenizer(path: Path, meta, config: ModelConfig) -> tuple:
    """-> (TokenizerFiles, config with the tokenizer's BOS and stop ids)."""
    style = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if style not in ADD_BOS_DEFAULT:
        raise BuildError(path, f"GGUF tokenizer model {style!r} is not supported (supported: llama, gpt2)")
    if not tokens:
        raise BuildError(path, "GGUF metadata has no tokenizer.ggml.tokens")
    if len(tokens) > config.vocab_size:
        raise BuildError(path, f"the tokenizer has {len(tokens)} tokens, token_embd.weight only {config.vocab_size} rows")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise BuildError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "eot", "eom")}
    tok = _spm(path, meta, tokens, types, ids) if style == "llama" else _byte_level(path, meta, tokens, types, ids)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", ADD_BOS_DEFAULT[style])) and ids["bos"] is not None
    tok_config = {"bos_token": _text(tokens, ids["bos"]), "eos_token": _text(tokens, ids["eos"]),
                  "unk_token": _text(tokens, ids["unknown"]), "add_bos_token": add_bos, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False, "model_max_length": config.max_position_embeddings}
    stops = tuple(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    generation = {"bos_token_id": ids["bos"], "eos_token_id": list(stops)}
    files = make_tokenizer_files(tok.to_str().encode(), tok_config, path,
                                 chat_template=meta.get("tokenizer.chat_template"),
                                 extra_files={"generation_config.json": json.dumps(generation, indent=2).encode()},
                                 bos_token_id=ids["bos"], eos_token_id=ids["eos"])
    return files, replace(config, bos_token_id=ids["bos"], eos_token_ids=stops)


def _text(tokens: list, token_id):
    return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[token_id]


def _spm(path: Path, meta, tokens: list, types: list, ids: dict):
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise BuildError(path, f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = ids["unknown"] if ids["unknown"] is not None else (types.index(UNKNOWN) if UNKNOWN in types else 0)
    vocab = Vocab(list(tokens), [float(s) for s in scores], [int(t) for t in types], unk,
                  ids["bos"] if ids["bos"] is not None else 1, ids["eos"] if ids["eos"] is not None else 2)
    tok = vocab_to_tokenizer(vocab)
    # llama.cpp matches user-defined pieces (chat markers such as <|im_start|>) whole, before BPE
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    if meta.get("tokenizer.ggml.add_space_prefix", True) is False:     # no dummy-prefix space
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _byte_level(path: Path, meta, tokens: list, types: list, ids: dict):
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise BuildError(path, "a gpt2-style GGUF tokenizer needs tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in SPLIT_PATTERNS:
        raise BuildError(path, f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(SPLIT_PATTERNS)})")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise BuildError(path, "tokenizer.ggml.merges holds an entry that is not two tokens separated by a space")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    bos = _text(tokens, ids["bos"])
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, ids["bos"])])
    return tok
