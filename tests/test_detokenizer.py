"""Incremental detokenization against tokenizer.decode, for byte-level BPE (the mock tokenizer)
and SentencePiece with byte fallback (the real tok512 vocabulary of stories260K), through the
byte-table fast path and the generic prefix/read-offset decoder; the cost bound on 10,000
tokens; and stop strings across token boundaries."""

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models

from tokenwire.core.detokenizer import (ByteTableDecoder, Detokenizer, IncrementalDecoder, StartOfTextDecoder,
                                        StopStringMatcher, TextStream, decoder_kind)
from tokenwire.kernels.mock import build_mock_tokenizer
from tokenwire.core.sampling_params import SamplingParams
from tokenwire.engine_build.tokenizer_convert import read_llama2c_vocab, vocab_to_tokenizer

TEXTS = ["Once upon a time, there was a little girl named Lily.", "Café naïve — 日本語 😀 and 🙂🙂!",
         "  spaces   and\ttabs\nnew lines  ", "Lily's mom said, \"Lily, let's go.\"", "x"]
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=40) | \
    st.sampled_from(TEXTS)


@pytest.fixture(scope="module")
def spm(stories260k_dir):
    return vocab_to_tokenizer(read_llama2c_vocab(stories260k_dir / "tok512.bin"))


@pytest.fixture(scope="module")
def byte_level():
    return build_mock_tokenizer()


def stream_text(decoder, ids):
    pieces = [decoder.push(i) for i in ids]
    return pieces, "".join(pieces) + decoder.finish()


def decoders_for(tok, prompt, skip=True):
    detok = Detokenizer(tok)
    return {"table": detok.decoder(prompt, skip),
            "generic": IncrementalDecoder(tok, prompt, skip, detok.special_ids)}


def test_both_vocabularies_take_the_fast_path(spm, byte_level):
    assert decoder_kind(spm) == "sentencepiece" and decoder_kind(byte_level) == "byte_level"
    assert Detokenizer(spm).byte_table(True) is not None
    assert Detokenizer(byte_level).byte_table(False) is not None
    assert isinstance(Detokenizer(spm).decoder([1, 403]), ByteTableDecoder)


@pytest.mark.parametrize("kind", ["table", "generic"])
@pytest.mark.parametrize("vocab", ["spm", "byte_level"])
@settings(max_examples=40, deadline=None)
@given(prompt_text=TEXT, text=TEXT)
def test_streamed_text_continues_the_prompt_exactly(request, vocab, kind, prompt_text, text):
    tok = request.getfixturevalue(vocab)
    prompt = tok.encode(prompt_text).ids
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, streamed = stream_text(decoders_for(tok, prompt)[kind], ids)
    full, head = tok.decode(prompt + ids), tok.decode(prompt)
    assert full.startswith(head) and streamed == full[len(head):]
    assert all("\ufffd" not in p for p in pieces)          # split characters are held, never half-emitted


@pytest.mark.parametrize("kind", ["table", "generic"])
def test_sentencepiece_prompt_of_bos_alone_starts_the_text(spm, kind):
    ids = spm.encode("Once upon a time", add_special_tokens=False).ids
    _, streamed = stream_text(decoders_for(spm, [1])[kind], ids)
    assert streamed == spm.decode([1] + ids) == "Once upon a time"
    assert isinstance(Detokenizer(spm).decoder([1]), StartOfTextDecoder)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 460), max_size=60))
def test_byte_level_random_ids_including_broken_utf8(byte_level, ids):
    prompt = byte_level.encode("Hi").ids
    for decoder in decoders_for(byte_level, prompt).values():
        _, streamed = stream_text(decoder, ids)
        assert streamed == byte_level.decode(prompt + ids)[len("Hi"):]


def test_special_tokens_skipped_or_kept(spm):
    ids = spm.encode("Hello", add_special_tokens=False).ids + [2] + spm.encode(" world", add_special_tokens=False).ids
    for skip, want in ((True, spm.decode([403] + ids)[len("Once"):]),
                       (False, spm.decode([403] + ids, skip_special_tokens=False)[len("Once"):])):
        for decoder in decoders_for(spm, [403], skip).values():
            assert stream_text(decoder, ids)[1] == want
    assert "</s>" in want


def test_ids_beyond_the_tokenizer_decode_to_nothing(spm):
    decoder = Detokenizer(spm).decoder([403])
    assert decoder.push(100_000) == "" and decoder.push(407) == " upon"


class CountingTokenizer:
    """Forwards decode() and counts calls and ids passed."""

    def __init__(self, inner):
        self.inner, self.calls, self.ids, self.max_ids = inner, 0, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        self.max_ids = max(self.max_ids, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_ten_thousand_tokens_cost_the_same_per_token_at_the_end(spm):
    """Counted operations, not time: decode calls and ids decoded per token, first 1,000 tokens
    against the last 1,000, over a stream with words, characters split into byte tokens, a run
    of skipped special tokens and a run of bytes that never form valid UTF-8."""
    block = (spm.encode(" ".join(TEXTS), add_special_tokens=False).ids + [2] * 60
             + [3 + 0x80] * 40 + spm.encode(" 日本語 😀 ok", add_special_tokens=False).ids)
    ids = (block * (10_000 // len(block) + 1))[:10_000]
    counter = CountingTokenizer(spm)
    decoder = IncrementalDecoder(counter, [1, 403], True, Detokenizer(spm).special_ids)
    marks = []
    pieces = []
    for i, token in enumerate(ids):
        if i % 1000 == 0:
            marks.append((counter.calls, counter.ids))
        pieces.append(decoder.push(token))
    marks.append((counter.calls, counter.ids))
    per_k = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    (first_calls, first_ids), (last_calls, last_ids) = per_k[0], per_k[-1]
    assert last_calls <= 1.1 * first_calls + 20 and last_ids <= 1.1 * first_ids + 200, per_k
    assert max(c for c, _ in per_k) <= 1.5 * 1000            # about 1.25 decode calls per token
    assert counter.max_ids <= IncrementalDecoder.MAX_WINDOW + IncrementalDecoder.MAX_PENDING + 1
    assert len(decoder.ids) < 2000                           # old ids are dropped, not kept forever
    text = "".join(pieces) + decoder.finish()
    assert text == spm.decode([1, 403] + ids)[len("Once"):]


def test_table_decoder_never_calls_decode_after_setup(spm):
    counter = CountingTokenizer(spm)
    decoder = Detokenizer(spm).decoder([1, 403])
    assert isinstance(decoder, ByteTableDecoder)
    for token in spm.encode(" ".join(TEXTS) * 50, add_special_tokens=False).ids:
        decoder.push(token)
    assert counter.calls == 0 and decoder.pending == b""


def test_metaspace_and_unrecognized_decoders():
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "##ing": 4, "▁go": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert decoder_kind(tok) == "sentencepiece"
    assert stream_text(Detokenizer(tok).decoder([1]), [2, 3, 5])[1] == tok.decode([1, 2, 3, 5])[len("hello"):]
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    assert decoder_kind(tok) is None
    decoder = Detokenizer(tok).decoder([1])
    assert isinstance(decoder, IncrementalDecoder)
    assert stream_text(decoder, [5, 4, 3])[1] == tok.decode([1, 5, 4, 3])[len(tok.decode([1])):]


# ------------------------------------------------------------------ stop strings

def test_stop_string_split_over_pushes_is_cut_and_held_text_released():
    m = StopStringMatcher(["STOP", "END!"])
    assert m.push("hello S") == "hello "             # "S" could start STOP: held
    assert m.push("T") == ""
    assert m.push("ar") == "STar"                    # diverged: released
    assert m.push(" ST") == " "
    assert m.push("OP and more") == "" and m.stopped


def test_the_stop_string_completed_first_wins_and_nothing_after_it_leaks():
    m = StopStringMatcher(["bc", "abcd"])
    assert m.push("xxab") == "xx"
    assert m.push("cd tail") == "a" and m.stopped            # "bc" completes before "abcd"
    m = StopStringMatcher(["bcd", "abcd", "zz"])
    assert m.push("xabcd") == "x" and m.stopped               # same end: the earlier start


def test_text_stream_finish_flushes_a_held_prefix_but_not_after_a_stop(spm):
    stream = Detokenizer(spm).stream([1, 403], SamplingParams(stop=("upon a dragon",)))
    assert isinstance(stream, TextStream)
    ids = spm.encode("upon a time", add_special_tokens=False).ids           # "▁upon ▁a ▁time"
    text = "".join(stream.push(i) for i in ids)
    assert not stream.stopped and text + stream.finish() == " upon a time"


@settings(max_examples=200, deadline=None)
@given(text=st.text("abc ", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
       stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_never_leak_whatever_the_chunking(text, cuts, stops):
    m = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    out = ""
    for a, b in zip(bounds, bounds[1:]):
        out += m.push(text[a:b])
        assert not any(s in out for s in stops)
        if m.stopped:
            break
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    first = min(hits)[1] if hits else -1                  # the stop that completes first
    if first >= 0:
        assert m.stopped and out == text[:first]
    else:
        assert not m.stopped and out + m.flush() == text
