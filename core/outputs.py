"""Records that cross from the engine thread to the event loop, once per step.

Every engine step is one `StepTokens`: its `RequestOutput`s (one per request that produced
something or finished), and for the server the common ones as columns; the server
dispatches each to its stream.
`Timeline` is the request's clock: the route stamps arrival and tokenization, the
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
    response_cached: bool = False       # answered from the exact-match response cache (core/response_cache.py)
    grammar_compile_ns: int = 0         # compiling the request's grammar (0: none, or cached)
    mask_ns: int = 0                    # filling its token masks, over all its steps (constrained only)
    spec_proposed: int = 0              # tokens proposed for it by speculative decoding (core/speculative.py)
    spec_accepted: int = 0              # of which verified and kept


class RequestOutput(NamedTuple):
    """What one step produced for one request."""
    request_id: int
    token_ids: Sequence[int]            # new token ids of this output (0 or 1; a step that verified
                                        # speculated tokens gives one output per token, in order)
    text: str                           # new text: stop strings cut, incomplete UTF-8 held back
    logprobs: Optional[Sequence[TopLogprobs]]  # one per new token when requested, else None
    finish_reason: Optional[str]        # None while the request runs
    num_prompt_tokens: int
    num_output_tokens: int              # generated so far, for usage
    step_done_ns: int                   # when the step that produced this finished
    error: Optional[str] = None         # set with FINISH_ERROR
    num_cached_tokens: int = 0          # prompt tokens whose K/V came from the prefix cache (at first admission)


class StepTokens:
    """One step's outputs: what `EngineCore.step()` returns. Without columns (or below
    COLUMNS_MIN_RUNNING running requests) every output is a row; with them (the server's
    choice, core/step_driver.StepHost.columns) the common ones are columns. Building
    one RequestOutput per token is most of a step's per-token cost (a tuple subclass: ~180 ns against ~25 ns for
    three list appends), so the common output, one token for a request that goes on, is
    three columns, and every other output (a finish, logprobs, a cancel, an error) is still
    a RequestOutput in `rows`. A request is in one or the other, never both."""
    __slots__ = ("request_ids", "token_ids", "texts", "rows", "step_done_ns")

    def __init__(self, rows: list, step_done_ns: int = 0):
        self.request_ids = []           # list[int] [n]
        self.token_ids = []             # list[int] [n]: each request's one new token
        self.texts = []                 # list[str] [n]: its new text (incomplete UTF-8 held back)
        self.rows = rows                # list[RequestOutput]: every other output
        self.step_done_ns = step_done_ns    # when the step's tokens were appended (0: none were)

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.rows)


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
    num_prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache (at each admission)
    num_prefix_cache_hits: int = 0      # of which found cached
    num_prefix_cached_blocks: int = 0   # KV blocks whose content the prefix cache can hand out
    num_response_cache_hits: int = 0    # requests answered from the exact-match response cache
    num_spec_proposed: int = 0          # speculative decoding: tokens proposed and verified
    num_spec_accepted: int = 0          # of which kept
    num_spec_steps: int = 0             # request-steps that verified proposals
