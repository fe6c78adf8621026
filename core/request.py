"""One request's state inside the engine: its lifecycle, its tokens and its KV blocks.

Rules:
1. The lifecycle is the table `TRANSITIONS`; `Request.transition` is the only way to change
   `state`, and a transition that is not in the table raises `IllegalTransition`.

       WAITING ──> PREFILLING ──> DECODING ──> FINISHED
          ^            │             │
          └────────────┴─────────────┘  preempted (recompute): back to WAITING
       any live state ──> CANCELLED | FAILED

   PREFILLING covers every step that feeds more than the last sampled token: the prompt in
   chunks, or after a preemption the prompt plus the tokens generated so far. The step whose
   chunk reaches the last known token samples, and the request becomes DECODING.
2. The sequence is prompt + output (`num_tokens` ids); `num_computed_tokens` of them are in
   the KV cache. A step feeds `tokens(num_computed_tokens, end)`, so prefill, decode and the
   recompute after a preemption are one code path.
3. The sampling RNG counter is `len(output_token_ids)`, so a recomputed request draws the
   same numbers it would have drawn without the preemption.
4. `block_table` and `output_token_ids` are never rebound (grown, cleared in place): the
   request's `decode_step` shares them.

No tensor library here: ints and lists.
"""

import enum
from typing import Optional

from .errors import IllegalTransition
from .executor import DecodeStep
from .outputs import Timeline
from .sampling_params import SamplingParams


class RequestState(enum.Enum):
    # members are singletons compared by identity: hash them by identity too, in C (Enum's own
    # __hash__ is a Python call, ~0.2 us per TRANSITIONS lookup, several per request)
    __hash__ = object.__hash__

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


S = RequestState
TRANSITIONS = {
    S.WAITING: frozenset({S.PREFILLING, S.CANCELLED, S.FAILED}),
    S.PREFILLING: frozenset({S.DECODING, S.WAITING, S.CANCELLED, S.FAILED}),
    S.DECODING: frozenset({S.WAITING, S.FINISHED, S.CANCELLED, S.FAILED}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
}
TERMINAL_STATES = frozenset(s for s, nexts in TRANSITIONS.items() if not nexts)
del S


class Request:
    """A request from submission to its end. Owned by the engine thread once submitted."""

    __slots__ = ("request_id", "params", "timeline", "priority", "arrival_seq", "seed",
                 "prompt_token_ids", "output_token_ids", "num_prompt_tokens", "step_done_ns",
                 "max_total_tokens", "max_output_tokens", "stop_token_ids", "text_stream", "state",
                 "num_computed_tokens", "num_scheduled_tokens", "block_table", "decode_step",
                 "finish_reason", "error", "num_preemptions", "block_hashes", "num_hashed_blocks",
                 "num_cached_tokens", "num_passed_over", "prefix_match", "leader", "followers", "constraint", "spec",
                 "num_pending", "sync_only")

    def __init__(self, request_id: int, prompt_token_ids: list, params: SamplingParams, timeline: Timeline, *,
                 seed: int, priority: int, arrival_seq: int, max_model_len: int,
                 stop_token_ids: frozenset, text_stream, constraint=None, sync_only: bool = False):
        self.request_id = request_id
        self.params = params
        self.timeline = timeline
        self.priority = priority                    # smaller is served first; ties by arrival
        self.arrival_seq = arrival_seq              # submission order, kept across preemption
        self.seed = seed                            # resolved: never None
        self.prompt_token_ids = prompt_token_ids    # list[int] [L]
        self.output_token_ids = []                  # list[int], grows by one per decode step
        self.num_prompt_tokens = len(prompt_token_ids)
        self.step_done_ns = timeline.step_done_ns   # the timeline's per-token stamps, one hop closer
        max_new = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_total_tokens = min(max_model_len, self.num_prompt_tokens + max_new)
        self.max_output_tokens = self.max_total_tokens - self.num_prompt_tokens   # the length stop, as a count
        self.stop_token_ids = stop_token_ids        # EOS (unless ignore_eos) + params.stop_token_ids
        self.text_stream = text_stream             # core/detokenizer: ids -> text, stop strings
        self.constraint = constraint                # core/constraint.TokenConstraint or None: output must match it
        self.state = RequestState.WAITING
        self.num_computed_tokens = 0                # tokens whose K/V are in the cache
        self.num_scheduled_tokens = 0               # tokens fed in the current step
        self.num_pending = 0                        # sampled rows launched whose token is not appended yet
        # its next step depends on the token just sampled (a grammar's mask, penalties, proposals):
        # a step is not scheduled ahead of its last one while it runs (core/step_driver.py)
        self.sync_only = sync_only
        self.block_table = []                       # list[int]: physical KV blocks, in position order
        # this request's SeqStep while DECODING, updated in place each step: token_ids is
        # (output_token_ids[-1],), set when that token is appended; start_pos when scheduled
        self.decode_step = DecodeStep(request_id, (), 0, self.block_table, True, params, seed,
                                      prompt_token_ids, self.output_token_ids, constraint)
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.num_preemptions = 0
        # prefix cache (core/block_manager.py): chained content hashes of this sequence's full
        # blocks, computed once as they are needed; the first `num_hashed_blocks` of
        # `block_table` are registered in the cache (or were taken from it)
        self.block_hashes = []                      # list[bytes]
        self.num_hashed_blocks = 0
        self.num_cached_tokens = 0                  # prompt tokens found cached at first admission
        self.num_passed_over = 0                    # admissions that went to a later request (scheduler rule 3)
        self.prefix_match = None                    # ((cache version, blocks looked up), cached blocks): prefix_cache.py
        # n > 1: the other choices of one API request follow the first (their leader): they
        # wait outside the queue until its prompt is computed, then find it in the prefix cache
        self.leader: Optional["Request"] = None
        self.followers = []                         # list[Request] parked on this one
        self.spec = None                            # core/speculative.SpecState, made at its first decode

    def transition(self, new_state: RequestState) -> None:
        if new_state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {new_state.value} "
                                    f"is not a legal transition")
        self.state = new_state

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list:
        """Ids [start, end) of prompt + output, without building the whole sequence."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple:
        """Admission and preemption order: priority first, then first come first served."""
        return (self.priority, self.arrival_seq)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, {self.state.value}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")
