"""A prompt's bound from its byte length (net/api/prompt_limits.py), checked against real
tokenizers, and large prompts tokenized off the loop by a real server (mock engine)."""

import json
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from tokenizers import Tokenizer, models, normalizers

import tokenwire
from tokenwire.kernels.mock import build_mock_tokenizer
from tokenwire.net.api.prompt_limits import LARGE_PROMPT_CHARS, Tokenizing, max_token_bytes, min_prompt_tokens

from clients.rawh2 import RawH2
from engines import engine_idle, wait_for


@pytest.fixture(scope="module")
def mock_tokenizer():
    return build_mock_tokenizer()


def random_text(rng, n):
    pieces = ["the", " robot", "  ", "\n", "é", "日本語", "🙂", "========", "Tok", ".", "'s", "1234", "\t"]
    return "".join(rng.choice(pieces) for _ in range(n))


def test_the_bound_never_exceeds_the_real_count(mock_tokenizer):
    k = max_token_bytes(mock_tokenizer)
    assert k is not None and k > 1
    rng = random.Random(0)
    for n in (1, 10, 100, 1000, 5000):
        for _ in range(20):
            text = random_text(rng, n)
            assert len(mock_tokenizer.encode(text, add_special_tokens=False).ids) >= min_prompt_tokens(text, k)


def test_the_longest_token_is_the_bound(mock_tokenizer):
    """Tight where it can be: a text that is one long vocabulary token repeated is close to it."""
    k = max_token_bytes(mock_tokenizer)
    vocab = mock_tokenizer.get_vocab()
    longest = max(vocab, key=lambda t: len(t.encode()))
    assert len(longest.encode()) == k


def bpe(unk=None, byte_fallback=False, normalizer=None):
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "<0x61>": 4}
    tok = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token=unk, byte_fallback=byte_fallback))
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


@pytest.mark.parametrize("tok,exact", [
    (bpe(), True),
    (bpe(unk="<unk>"), False),                                  # a fused unknown covers any length
    (bpe(unk="<unk>", byte_fallback=True), True),
    (bpe(normalizer=normalizers.NFKC()), False),                # can shorten text
    (bpe(normalizer=normalizers.Lowercase()), False),
    (bpe(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])), True),
    (bpe(normalizer=normalizers.Replace("ab", "")), False),
    (Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), False),
    (Tokenizer(models.Unigram([("a", -1.0), ("<unk>", -10.0)], unk_id=1, byte_fallback=False)), False),
], ids=["bpe", "bpe-unk", "bpe-byte-fallback", "nfkc", "lowercase", "metaspace-like", "shortening-replace",
        "wordpiece", "unigram"])
def test_exact_only_where_it_is(tok, exact):
    assert (max_token_bytes(tok) is not None) == exact


@pytest.fixture(scope="module")
def server():
    s = tokenwire.Server(backend="mock", port=0, max_model_len=65536).start()
    yield s
    s.stop()


class HeldTokenizer:
    """encode_batch blocks on the text "held" until released: a prompt that takes long."""

    def __init__(self):
        self.release = threading.Event()

    def encode_batch(self, texts, add_special_tokens):
        if texts[0] == "held":
            assert self.release.wait(30)
        return [SimpleNamespace(ids=[len(texts[0])])]


def test_a_large_prompt_is_not_queued_behind_one_still_tokenizing():
    """With one worker thread, a prompt of a few MB (about a second) held every large prompt
    submitted after it; the workers are at least two. Deterministic: the first never ends until
    the second has."""
    tok = HeldTokenizer()
    tokenizing = Tokenizing(tok)
    try:
        held = tokenizing.submit("held", [1])
        assert tokenizing.submit("abc", [1]).result(timeout=30) == [1, 3]
        assert not held.done()
        tok.release.set()
        assert held.result(timeout=30) == [1, 4]
    finally:
        tok.release.set()
        tokenizing.close()


def test_a_prompt_over_the_context_by_its_bytes_is_400_without_tokenizing(server):
    prompt = "word " * 400_000      # 2 MB: at least 100 000 tokens by bytes alone
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5     # tokenizing it takes seconds on this machine


def test_a_large_prompt_that_fits_is_tokenized_off_the_loop_and_served(server):
    tokenizer = server.app.model.tokenizer
    prompt = "the robot " * (LARGE_PROMPT_CHARS // 4)            # 40 KiB, ~8k tokens
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    expected = len(server.app.model.encode(prompt))
    assert expected == len(tokenizer.encode(prompt, add_special_tokens=False).ids) + len(server.app.model.encode(""))
    assert r.json()["usage"]["prompt_tokens"] == expected


def test_a_large_prompt_reset_while_tokenizing_is_never_submitted(server):
    c = RawH2("127.0.0.1", server.port)
    try:
        prompt = "the robot " * 20_000           # 200 KB: tokenizing takes a while
        c.read_until(lambda: c.conn.outbound_flow_control_window > len(prompt) + 100)    # the server's windows
        body = json.dumps({"prompt": prompt, "max_tokens": 1000, "stream": True, "ignore_eos": True}).encode()
        sid = c.conn.get_next_available_stream_id()
        c.conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                                  (":authority", c.host)])
        for i in range(0, len(body), 16384):
            c.conn.send_data(sid, body[i:i + 16384], end_stream=i + 16384 >= len(body))
        c.flush()
        time.sleep(0.05)                          # read and handed to the worker thread
        c.reset(sid)
        health = c.get("/health")
        c.read_until(lambda: health in c.ended)
    finally:
        c.close()
    assert wait_for(lambda: engine_idle(server)), server.engine.stats()
    assert not any(p.outbox.streams for p in list(server.app.connections))
