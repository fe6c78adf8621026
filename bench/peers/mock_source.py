"""The mock engine as the peer servers see it: kernels/mock.py's token sequence at its step time.

tokenwire runs the mock executor (kernels/mock.py) behind its scheduler; a peer has no
scheduler, so each request iterates this source directly: token i is ready at `start + (i + 1) * step` (an
absolute deadline, so timer granularity adds jitter but no drift), and with a zero-cost
step every token is ready at once. The sequence comes from the mock executor itself and
its text from tokenwire's detokenizer, so every server streams the same tokens and bytes.
"""

import asyncio
import time
from typing import AsyncIterator, NamedTuple, Optional

from ...core.detokenizer import Detokenizer
from ...core.sampling_params import SamplingParams
from ...kernels.mock import MockExecutor


class MockToken(NamedTuple):
    index: int                      # position in the output
    token_id: int
    text: str
    finish_reason: Optional[str]    # "length" on the last token, else None


class MockTokens:
    def __init__(self, step_us: float):
        self.step_s = step_us / 1e6
        self.token_ids, self.texts = token_sequence()

    async def stream(self, max_tokens: int) -> AsyncIterator[MockToken]:
        """`max_tokens` tokens, cycling through the sequence (per token: one yield, maybe one sleep)."""
        ids, texts, n = self.token_ids, self.texts, len(self.token_ids)
        start = time.monotonic()
        for i in range(max_tokens):
            if self.step_s:
                delay = start + (i + 1) * self.step_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            yield MockToken(i, ids[i % n], texts[i % n], "length" if i == max_tokens - 1 else None)


def token_sequence() -> tuple:
    """(token ids, their texts): one cycle of the mock executor's sequence, each token's text
    as tokenwire's own detokenizer streams it ("" while a UTF-8 character is incomplete)."""
    executor = MockExecutor(step_us=0)
    ids = list(executor.text_token_ids)
    stream = Detokenizer(executor.tokenizer).stream([], SamplingParams())
    texts = [stream.push(token_id) for token_id in ids]
    texts[-1] += stream.finish()
    return ids, texts
