"""llama2.c / SentencePiece vocabularies -> tokenizer.json, checked on the real tok512 files:
the ids of SOURCE.md, run.c's exact stdout from reference_greedy.json, byte fallback, round
trips, the `sentencepiece` package as an oracle, and clear errors for bad files."""

import io
import json
import struct

import pytest

from tokenwire.core.errors import BuildError
from tokenwire.engine_build.tokenizer_convert import (BYTE, CONTROL, NORMAL, UNKNOWN, read_any_vocab,
                                                     read_llama2c_vocab, read_sentencepiece_model,
                                                     sentencepiece_model_to_tokenizer_json, vocab_to_tokenizer)

TEXTS = ["Once upon a time", "Hello world!\nNew line here.", "Café naïve — 日本語 😀", "a", "",
         'Lily\'s mom said, "Lily, let\'s go to the park."', "x\ty", "1234 + 5678 = 6912", "trailing space "]


@pytest.fixture(scope="module")
def vocabs(stories260k_dir):
    return read_llama2c_vocab(stories260k_dir / "tok512.bin"), read_sentencepiece_model(stories260k_dir / "tok512.model")


@pytest.fixture(scope="module")
def tok(vocabs):
    return vocab_to_tokenizer(vocabs[0])


def test_both_formats_read_the_same_vocabulary(vocabs):
    bin_vocab, model_vocab = vocabs
    assert len(bin_vocab.pieces) == 512
    assert bin_vocab.pieces == model_vocab.pieces
    assert bin_vocab.scores == model_vocab.scores
    assert bin_vocab.types == model_vocab.types
    assert bin_vocab.pieces[:3] == ["<unk>", "<s>", "</s>"]
    assert bin_vocab.types[:4] == [UNKNOWN, CONTROL, CONTROL, BYTE] and bin_vocab.types[259] == NORMAL
    assert bin_vocab.pieces[13] == "<0x0A>"
    assert (bin_vocab.pieces[403], bin_vocab.pieces[407]) == ("\u2581Once", "\u2581upon")
    assert (model_vocab.unk_id, model_vocab.bos_id, model_vocab.eos_id) == (0, 1, 2)


def test_both_formats_convert_to_identical_tokenizer_json(vocabs, stories260k_dir):
    assert vocab_to_tokenizer(vocabs[0]).to_str() == sentencepiece_model_to_tokenizer_json(
        stories260k_dir / "tok512.model").decode()


def test_once_upon_a_time(tok):
    assert tok.encode("Once upon a time", add_special_tokens=False).ids == [403, 407, 261, 378]
    assert tok.encode("Once upon a time").ids == [1, 403, 407, 261, 378]     # BOS like run.c


def test_byte_fallback_decodes_to_bytes(tok):
    assert tok.decode([13]) == "\n"
    ids = tok.encode("hi\nthere", add_special_tokens=False).ids
    assert 13 in ids and tok.decode(ids) == "hi\nthere"
    emoji = tok.encode("😀", add_special_tokens=False).ids          # not in the vocabulary: 4 UTF-8 bytes
    assert emoji[-4:] == [b + 3 for b in "😀".encode()] and tok.decode(emoji) == "😀"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("text", [t for t in TEXTS if t and not t.endswith(" ")])
def test_matches_sentencepiece(stories260k_dir, tok, text):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(stories260k_dir / "tok512.model"))
    assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text)


def test_decodes_run_c_stdout_exactly(stories260k_dir, tok):
    """run.c prints every emitted piece (the leading space after BOS stripped), then a newline."""
    reference = json.loads((stories260k_dir / "reference_greedy.json").read_text())
    assert reference["prompt_token_ids"] == tok.encode(reference["prompt"]).ids
    for run in reference["runs"]:
        assert tok.decode(run["stream_token_ids"]) + "\n" == run["stdout"]


def test_runs_of_spaces_are_kept(tok):
    """run.c (and this tokenizer) keep runs of spaces; sentencepiece's normalizer would collapse them."""
    assert tok.decode(tok.encode("a   b").ids) == "a   b"


# ---- bad files ---------------------------------------------------------------------------

def test_truncated_llama2c_vocab(tmp_path, stories260k_dir):
    data = (stories260k_dir / "tok512.bin").read_bytes()
    (tmp_path / "tok.bin").write_bytes(data[:1000])
    with pytest.raises(BuildError, match=r"tok\.bin.*(truncated|corrupt) llama2\.c tokenizer"):
        read_llama2c_vocab(tmp_path / "tok.bin", 512)


def test_llama2c_vocab_with_too_few_entries(tmp_path):
    (tmp_path / "tok.bin").write_bytes(struct.pack("<i", 3) + struct.pack("<fi", 0.0, 1) + b"a")
    with pytest.raises(BuildError, match=r"tok\.bin: llama2\.c tokenizer has 1 entries, the checkpoint needs 512"):
        read_llama2c_vocab(tmp_path / "tok.bin", 512)


def test_corrupt_sentencepiece_model(tmp_path, stories260k_dir):
    data = (stories260k_dir / "tok512.model").read_bytes()
    (tmp_path / "bad.model").write_bytes(data[:-37])     # cut inside the last message
    with pytest.raises(BuildError, match=r"bad\.model: corrupt SentencePiece model"):
        read_sentencepiece_model(tmp_path / "bad.model")


def test_not_a_sentencepiece_model(tmp_path):
    (tmp_path / "x.model").write_bytes(b"\x00\x00\x00")
    with pytest.raises(BuildError, match=r"x\.model: (corrupt SentencePiece model|not a SentencePiece model)"):
        read_sentencepiece_model(tmp_path / "x.model")


def test_unigram_sentencepiece_is_refused(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["the cat sat on the mat"] * 50 + ["a dog ran far"] * 50),
                                   model_writer=model, vocab_size=19, model_type="unigram", minloglevel=2)
    (tmp_path / "uni.model").write_bytes(model.getvalue())
    with pytest.raises(BuildError, match=r"uni\.model: SentencePiece model_type 1 is not supported"):
        read_sentencepiece_model(tmp_path / "uni.model")


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(BuildError, match="nope.bin: missing tokenizer file"):
        read_any_vocab(tmp_path / "nope.bin")
