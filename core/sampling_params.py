"""Typed, validated sampling parameters for one request.

The server builds these from the API body; a bad value raises `InvalidParameter`
naming the parameter, which net/ turns into a 400 with `param` set. Defaults follow the
OpenAI API (temperature 1, top_p 1). `seed=None` means the scheduler draws one at
submission, so every request samples from its own deterministic stream (see kernels/sampling.py).
"""

from dataclasses import dataclass, field, replace
from typing import Optional


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_TOP_LOGPROBS = 20
SPECULATIVE_METHODS = ("ngram", "draft", "off")     # core/speculative.py; "draft" needs --speculative-model
MAX_SPECULATIVE_TOKENS = 16             # proposed tokens verified per step, at most


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: Optional[int] = None     # None: until EOS or the context is full
    min_tokens: int = 0                  # vLLM's: no EOS, stop id or stop string before this many tokens
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # >1 discourages tokens already in prompt or output
    frequency_penalty: float = 0.0       # OpenAI: subtract count * penalty from logits
    presence_penalty: float = 0.0        # OpenAI: subtract penalty once a token has appeared
    seed: Optional[int] = None
    stop: tuple = field(default_factory=tuple)            # stop strings, never in the output
    stop_token_ids: tuple = field(default_factory=tuple)  # extra ids that end generation
    ignore_eos: bool = False
    logprobs: Optional[int] = None       # None: off; N >= 0: chosen token's logprob plus top N
    skip_special_tokens: bool = True
    speculative: Optional[str] = None    # a SPECULATIVE_METHODS name; None: the server's --speculative
    num_speculative_tokens: Optional[int] = None    # k, tokens proposed per step; None: the server's

    def __post_init__(self):
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must not exceed max_tokens ({self.max_tokens})")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64),
               "seed", "must be an integer in [0, 2**64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               "logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.speculative is None or self.speculative in SPECULATIVE_METHODS, "speculative",
               f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        _check(self.num_speculative_tokens is None or (isinstance(self.num_speculative_tokens, int)
                                                       and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS),
               "num_speculative_tokens", f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def choice_params(params: SamplingParams, n: int) -> list:
    """The params of each of `n` choices of one request (n > 1, best_of). Derived seeds: choice
    i samples with seed `(seed + i) mod 2**64`, so choice 0 is what the request alone gives and
    choice i is what a single request with that seed gives; without a seed, each choice draws
    its own at submission. -> list[SamplingParams]"""
    if params.seed is None:
        return [params] * n
    return [params] + [replace(params, seed=(params.seed + i) % 2**64) for i in range(1, n)]


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, f"{param} {message}")
