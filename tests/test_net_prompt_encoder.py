"""net/api/prompt_encoder.py: the piece-cached prompt encoder gives the tokenizer's own ids."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tokenwire.kernels.mock import MOCK_TEXT, build_mock_tokenizer
from tokenwire.net.api.prompt_encoder import GPT2_PATTERN, PieceEncoder, _ascii_pattern, piece_encoder

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
# letters, digits, white space of every kind (also \x1c-\x1f, which Python's \s has and Unicode's has not),
# apostrophes, punctuation, accents, CJK, emoji, and the added tokens' text
ALPHABET = st.sampled_from(list("aAzZ tT'sdlmrve0129 \t\n\r\x0b\x0c\x1c\x1f\x85\xa0.,!?-_\"()éïÅ日本語🙂\u2003")
                           + ["<s>", "</s>", "'ll", "  ", "\r\n", "Tok", " time", "e\u0301"])
TEXTS = st.lists(ALPHABET, max_size=40).map("".join)


@pytest.fixture(scope="module")
def mock_tokenizer():
    return build_mock_tokenizer()


@pytest.fixture(scope="module")
def qwen2_style_tokenizer():
    """A Qwen2-shaped tokenizer: NFC, Split(pattern, isolated) + ByteLevel without regex, trained here."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([MOCK_TEXT * 3, "It's 2024: we'll see 12345 numbers.\r\n\r\n  Done!"], trainer)
    return tok


def test_mock_tokenizer_texts(mock_tokenizer):
    enc = piece_encoder(mock_tokenizer)
    assert enc is not None
    for text in [MOCK_TEXT, " ".join(["a"] * 16), "", "  leading and trailing  ", "it's 42!\n\n\tx", "<s>hi</s>"]:
        assert enc.encode(text) == mock_tokenizer.encode(text, add_special_tokens=False).ids, text
    assert enc.enabled


@settings(max_examples=300, deadline=None)
@given(TEXTS)
def test_mock_tokenizer_random_texts(mock_tokenizer, text):
    enc = _encoder(mock_tokenizer)
    for _ in range(2):                  # the second time from cached pieces, past the verified prompts
        assert enc.encode(text) == mock_tokenizer.encode(text, add_special_tokens=False).ids
    assert enc.enabled


@settings(max_examples=300, deadline=None)
@given(TEXTS)
def test_split_and_nfc_tokenizer_random_texts(qwen2_style_tokenizer, text):
    enc = _encoder(qwen2_style_tokenizer)
    for _ in range(2):
        assert enc.encode(text) == qwen2_style_tokenizer.encode(text, add_special_tokens=False).ids
    assert enc.enabled


_ENCODERS = {}


def _encoder(tokenizer) -> PieceEncoder:
    """One encoder per tokenizer across examples, past its verified start, so the fast path answers."""
    enc = _ENCODERS.get(id(tokenizer))
    if enc is None:
        enc = _ENCODERS[id(tokenizer)] = piece_encoder(tokenizer)
        for i in range(40):
            enc.encode(f"warm up {i}")
    return enc


def test_unhandled_shapes_give_none():
    whitespace = Tokenizer(models.BPE())
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    assert piece_encoder(whitespace) is None
    prefix = build_mock_tokenizer()
    prefix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert piece_encoder(prefix) is None
    lowercase = build_mock_tokenizer()
    lowercase.normalizer = normalizers.Lowercase()
    assert piece_encoder(lowercase) is None
    assert piece_encoder(object()) is None


def test_a_wrong_split_is_caught_and_turned_off(mock_tokenizer, caplog):
    # one piece per character: the tokenizer keeps " a" whole, so the first such piece turns it off
    enc = PieceEncoder(mock_tokenizer, r".", False, False, ["<s>", "</s>"])
    text = "Once upon a time"
    with caplog.at_level(logging.WARNING, logger="tokenwire.net"):
        assert enc.encode(text) == mock_tokenizer.encode(text, add_special_tokens=False).ids
    assert not enc.enabled and "fast prompt encoding is off" in caplog.text
    assert enc.encode(text) == mock_tokenizer.encode(text, add_special_tokens=False).ids


def test_a_wrong_join_is_caught_by_verification(mock_tokenizer):
    # pieces the tokenizer accepts one by one, cut where it would not: only whole-prompt checks see it
    enc = PieceEncoder(mock_tokenizer, r"\S+|\s", False, False, [])
    text = "a  time"                        # ours: "a", " ", " ", "time"; the tokenizer's: "a", " ", " time"
    assert enc.encode(text) == mock_tokenizer.encode(text, add_special_tokens=False).ids
    assert not enc.enabled


def test_ascii_pattern():
    assert _ascii_pattern(GPT2_PATTERN) == (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^ \t\n\x0b\x0c\rA-Za-z0-9]+"
        r"|[ \t\n\x0b\x0c\r]+(?![^ \t\n\x0b\x0c\r])|[ \t\n\x0b\x0c\r]+")
    assert _ascii_pattern(r"\w+") is None               # not spelled out: the regex module splits instead
    assert _ascii_pattern(r"\p{Lu}") is None
    assert _ascii_pattern(r"[[:alpha:]]") is None
    assert _ascii_pattern(r"[^\S]") is None


def test_engine_prompt_encoder_keeps_the_engine_rule(tmp_path):
    """The embedded default model (byte-level BPE) serves completion prompts through the fast path,
    with the engine's BOS rule, giving encode_prompt's ids."""
    from tokenwire.engine_build.default_model import default_engine_path
    from tokenwire.kernels.engine_format import load_engine
    from tokenwire.net.api.model_info import prompt_encoder
    engine_dir = load_engine(default_engine_path(cache_dir=tmp_path))
    encode = prompt_encoder(engine_dir)
    assert encode is not engine_dir.encode_prompt
    for text in [MOCK_TEXT, "Once upon a time", "It's 12:30 -- time for tea!\n\n", "café 日本語 🙂", "<|im_end|>x"]:
        for _ in range(2):
            assert encode(text) == engine_dir.encode_prompt(text), text
    engine_dir.add_bos, engine_dir.bos_token_id = True, 7      # an engine that puts BOS in front
    encode = prompt_encoder(engine_dir)
    assert encode("Once upon a time") == engine_dir.encode_prompt("Once upon a time")
    assert encode("Once upon a time")[0] == 7
