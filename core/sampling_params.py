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
        """Every value checked; a message is built only for the one that fails (once per request)."""
        max_tokens, min_tokens = self.max_tokens, self.min_tokens
        if not (max_tokens is None or (isinstance(max_tokens, int) and max_tokens >= 1)):
            _fail("max_tokens", "must be an integer >= 1")
        if not (isinstance(min_tokens, int) and min_tokens >= 0):
            _fail("min_tokens", "must be an integer >= 0")
        if not (max_tokens is None or min_tokens <= max_tokens):
            _fail("min_tokens", f"must not exceed max_tokens ({max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            _fail("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            _fail("top_k", "must be an integer >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            _fail("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail("presence_penalty", "must be in [-2, 2]")
        if not (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64)):
            _fail("seed", "must be an integer in [0, 2**64)")
        if self.stop and not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "must be non-empty strings")
        if not (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS)):
            _fail("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not (self.speculative is None or self.speculative in SPECULATIVE_METHODS):
            _fail("speculative", f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not (k is None or (isinstance(k, int) and 0 <= k <= MAX_SPECULATIVE_TOKENS)):
            _fail("num_speculative_tokens", f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]")

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


def _fail(param: str, message: str):
    raise InvalidParameter(param, f"{param} {message}")
