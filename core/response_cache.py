"""The exact-match response cache: finished answers, replayed for the same request.

Contract:
- Off unless the engine is given a size (`tokenwire serve --response-cache-size N`): then
  a bounded LRU of N answers, owned by the engine thread (no lock: only it reads or writes).
- Eligible: a request whose output is a pure function of its input: greedy (temperature 0),
  or sampled with an explicit seed, and no logprobs (they are not recorded). The key is
  the prompt's token ids and the whole `SamplingParams` (frozen, compared field by field:
  max_tokens, stop strings and ids, penalties, seed, ...), so a request that differs in any
  parameter never matches. One engine serves one model, so the model is implied.
- Stored: only answers that finished by themselves (stop or length), never a cancelled or
  failed one; the per-token texts are the detokenizer's again over the output ids (the same
  pieces the live answer streamed, stop strings and held-back UTF-8 included).
- A hit is answered by the engine thread at the start of its next step without touching the
  scheduler or the model: one RequestOutput per token, as a live answer's, all in that step
  (the wire's speed, not the model's), the last with the finish reason; the request's
  timeline says `response_cached`.
Pairs: put / get.
"""

from collections import OrderedDict
from typing import NamedTuple, Optional

from .outputs import FINISH_LENGTH, FINISH_STOP
from .request import Request


class CachedAnswer(NamedTuple):
    token_ids: tuple                    # the output ids
    texts: tuple                        # the text each token streamed (the last one's includes the flush)
    finish_reason: str


class ResponseCache:
    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"the response cache needs at least 1 entry, got {max_entries}")
        self.max_entries = max_entries
        self.entries = OrderedDict()    # _key(request) -> CachedAnswer, oldest first
        self.num_hits = 0

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        # a constrained request's answer depends on its grammar, which the key does not hold
        return (p.temperature == 0.0 or p.seed is not None) and p.logprobs is None and req.constraint is None

    def get(self, req: Request) -> Optional[CachedAnswer]:
        if not self.eligible(req):
            return None
        key = _key(req)
        answer = self.entries.get(key)
        if answer is not None:
            self.entries.move_to_end(key)
            self.num_hits += 1
        return answer

    def put(self, req: Request, detokenizer) -> None:
        """Record a request that finished by itself (stop or length)."""
        if req.finish_reason not in (FINISH_STOP, FINISH_LENGTH) or not req.output_token_ids or not self.eligible(req):
            return
        key = _key(req)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        stream = detokenizer.stream(req.prompt_token_ids, req.params)
        texts = ["" if t in req.stop_token_ids else stream.push(t) for t in req.output_token_ids]
        texts[-1] += stream.finish()
        self.entries[key] = CachedAnswer(tuple(req.output_token_ids), tuple(texts), req.finish_reason)
        if len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


def _key(req: Request) -> tuple:
    """The prompt ids and every sampling parameter (lists as tuples, so it hashes)."""
    params = tuple(tuple(v) if isinstance(v, list) else v for v in vars(req.params).values())
    return tuple(req.prompt_token_ids), params
