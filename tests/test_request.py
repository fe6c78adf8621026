"""The request lifecycle table: every legal transition works, every other one raises."""

import itertools

import pytest

from tokenwire.core.errors import IllegalTransition
from tokenwire.core.outputs import Timeline
from tokenwire.core.request import TERMINAL_STATES, TRANSITIONS, Request, RequestState as S
from tokenwire.core.sampling_params import SamplingParams

LEGAL = {
    (S.WAITING, S.PREFILLING), (S.WAITING, S.CANCELLED), (S.WAITING, S.FAILED),
    (S.PREFILLING, S.DECODING), (S.PREFILLING, S.WAITING), (S.PREFILLING, S.CANCELLED), (S.PREFILLING, S.FAILED),
    (S.DECODING, S.WAITING), (S.DECODING, S.FINISHED), (S.DECODING, S.CANCELLED), (S.DECODING, S.FAILED),
}


def make_request(prompt=(5, 6, 7), max_tokens=None, max_model_len=100):
    return Request(1, list(prompt), SamplingParams(max_tokens=max_tokens), Timeline(), seed=3, priority=0,
                   arrival_seq=0, max_model_len=max_model_len, stop_token_ids=frozenset(), text_stream=None)


def test_table_is_exactly_the_documented_lifecycle():
    assert {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts} == LEGAL
    assert TERMINAL_STATES == {S.FINISHED, S.CANCELLED, S.FAILED}


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_every_transition(src, dst):
    req = make_request()
    req.state = src
    if (src, dst) in LEGAL:
        req.transition(dst)
        assert req.state is dst
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            req.transition(dst)
        assert req.state is src


def test_tokens_slices_prompt_plus_output():
    req = make_request(prompt=[10, 11, 12])
    req.output_token_ids += [20, 21]
    whole = [10, 11, 12, 20, 21]
    assert req.num_tokens == 5
    for start in range(6):
        for end in range(start, 6):
            assert req.tokens(start, end) == whole[start:end]


def test_max_total_tokens_is_the_tighter_of_max_tokens_and_context():
    assert make_request(prompt=[1] * 10, max_tokens=5, max_model_len=100).max_total_tokens == 15
    assert make_request(prompt=[1] * 10, max_tokens=500, max_model_len=100).max_total_tokens == 100
    assert make_request(prompt=[1] * 10, max_tokens=None, max_model_len=100).max_total_tokens == 100
