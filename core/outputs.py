"""Records that cross from the engine thread to the event loop, once per step.

The engine thread ends every step by handing the loop one list of `RequestOutput`s (one
per request that produced something or finished); the server dispatches each to its
stream. `Timeline` is the request's clock: the route stamps arrival and tokenization, the
scheduler the rest, net/ the moment the first token reached the transport.
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from .executor import TopLogprobs

# finish reasons, as the OpenAI API spells them where it has one
FINISH_STOP = "stop"            # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"        # max_tokens or the context length
FINISH_CANCELLED = "cancelled"  # the client went away
FINISH_ERROR = "error"          # the engine failed this request; `error` says why


@dataclass
class Timeline:
    """Monotonic nanosecond stamps (time.monotonic_ns()); 0 means not reached."""
    arrived_ns: int = 0                 # request headers complete (net/)
    tokenized_ns: int = 0               # prompt ids ready (net/)
    queued_ns: int = 0                  # accepted by the scheduler
    first_scheduled_ns: int = 0         # first step that included it
    step_done_ns: list = field(default_factory=list)  # per generated token: its step finished
    first_token_emitted_ns: int = 0     # first token handed to the transport (net/)
    finished_ns: int = 0


class RequestOutput(NamedTuple):
    """What one step produced for one request."""
    request_id: int
    token_ids: Sequence[int]            # new token ids this step (0 or 1 today)
    text: str                           # new text: stop strings cut, incomplete UTF-8 held back
    logprobs: Optional[Sequence[TopLogprobs]]  # one per new token when requested, else None
    finish_reason: Optional[str]        # None while the request runs
    num_prompt_tokens: int
    num_output_tokens: int              # generated so far, for usage
    step_done_ns: int                   # when the step that produced this finished
    error: Optional[str] = None         # set with FINISH_ERROR


class EngineStats(NamedTuple):
    """A consistent snapshot for /metrics and /health."""
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int                # counters since start
    num_cancellations: int
    num_tokens_generated: int
    num_steps: int
    engine_alive: bool
