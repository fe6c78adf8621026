"""The contract between the scheduler and whatever runs the model.

The scheduler (core/scheduler.py) decides, each step, which tokens of which sequences go
through the model; it hands the executor a list of `SeqStep` records and gets back one
sampled token per sequence that asked for one (a step's records are `SeqStep`s, or
`DecodeStep`s: the same fields, kept per decoding request and updated in place; read them
by field name, and only during the step). Everything device-side — the KV cache
arrays, weights, streams, graphs — belongs to the executor. The scheduler only moves
ints and lists (block ids, token ids), so it tests in microseconds with a fake executor.

Backends implement `Executor`: the CPU model runner (numpy reference forward or C
kernels), the CUDA backend, and the mock engine used by benchmarks.
"""

from typing import NamedTuple, Optional, Protocol, Sequence

from .config import ModelConfig
from .constraint import TokenConstraint
from .sampling_params import SamplingParams


class SeqStep(NamedTuple):
    """One sequence's share of an engine step."""
    seq_id: int                         # the request's id, stable across preemption
    token_ids: Sequence[int]            # tokens fed this step: a prefill chunk, or the one decode token
    start_pos: int                      # tokens of this sequence already in the KV cache
    block_table: Sequence[int]          # physical KV blocks for positions [0, start_pos + len(token_ids))
    sample: bool                        # chunk ends at the last known token: sample the next one
    sampling: SamplingParams
    seed: int                           # the request's resolved seed (drawn when the request gave none)
    prompt_token_ids: Sequence[int]     # repetition penalty context
    output_token_ids: Sequence[int]     # generated so far; len() is the RNG counter for the next draw
    constraint: Optional[TokenConstraint] = None    # the request's grammar: the sampler masks this row
    # speculative decoding (core/speculative.py): the last `num_spec` of `token_ids` are proposed
    # tokens to verify. The executor returns logits, and samples, for the last 1 + num_spec rows;
    # row j samples as if output_token_ids ended with those proposals' first j (RNG counter
    # len(output_token_ids) + j, penalties over them too): core/speculative.sampling_rows
    num_spec: int = 0
    # overlapped steps (core/step_driver.py): 1 when the token this step feeds is the one this
    # executor sampled for the sequence at its previous step, which the host has not read yet
    # (token_ids[0] is then stale: the executor feeds its own), and output_token_ids lacks it (the
    # RNG counter is len(output_token_ids) + 1). Only executors with `overlaps` get such rows;
    # never with num_spec, a constraint or penalties (those rows wait for the host)
    num_pending: int = 0


class DecodeStep:
    """A `SeqStep` the scheduler keeps for each decoding request and updates in place.

    Same fields, same meaning, read by attribute as a `SeqStep` is (executors read every
    step record by field name only; none indexes or unpacks one). A decode changes only
    `token_ids` and `start_pos` from one step to the next, and building a fresh 9-field
    record per request per step was a third of the scheduler's per-step cost. Like the
    lists a `SeqStep` already shares with its request (block_table, output_token_ids),
    its values hold for the `step()` it is passed to, not after.
    """

    __slots__ = SeqStep._fields

    def __init__(self, seq_id: int, token_ids: Sequence[int], start_pos: int, block_table: Sequence[int],
                 sample: bool, sampling: SamplingParams, seed: int, prompt_token_ids: Sequence[int],
                 output_token_ids: Sequence[int], constraint: Optional[TokenConstraint] = None, num_spec: int = 0,
                 num_pending: int = 0):
        self.seq_id = seq_id
        self.token_ids = token_ids
        self.start_pos = start_pos
        self.block_table = block_table
        self.sample = sample
        self.sampling = sampling
        self.seed = seed
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.constraint = constraint
        self.num_spec = num_spec
        self.num_pending = num_pending

    def __repr__(self) -> str:
        return (f"DecodeStep(seq_id={self.seq_id}, token_ids={self.token_ids}, start_pos={self.start_pos}, "
                f"blocks={len(self.block_table)})")


class TopLogprobs(NamedTuple):
    """Log-probabilities for one sampled position."""
    token_logprob: float                # of the sampled token
    top_ids: Sequence[int]              # the N most likely ids, best first
    top_logprobs: Sequence[float]


class StepOutput(NamedTuple):
    """What one engine step produced, in the order of the `SeqStep`s with `sample=True`: one
    token per such step, 1 + num_spec for a speculating one (its rows in order)."""
    token_ids: Sequence[int]
    logprobs: Optional[Sequence[Optional[TopLogprobs]]] = None  # None when no sequence asked
    # the executor's own time for the step (its device's, ns), 0 where it keeps none: the engine
    # then times it from the host, which on a busy host also counts the waits for the GIL
    # (core/step_costs.py learns prefill and row costs from it)
    busy_ns: int = 0


class Executor(Protocol):
    """A step is `launch(seqs)`, which enqueues it and returns a handle, then `collect(handle)`,
    which waits for it (releasing the GIL) and returns its ids; `step(seqs)` is both. Steps are
    collected in launch order, on one thread at a time. The SeqSteps are read during `launch`
    only: the host may change them (and the lists they share) before `collect`."""
    config: ModelConfig
    block_size: int                     # tokens per KV block
    num_blocks: int                     # KV blocks the executor allocated
    # launch may run while the previous step runs (its kernels release the GIL or run on a
    # device), and takes rows with num_pending: the step driver overlaps its host work with it
    overlaps: bool

    def launch(self, seqs: Sequence[SeqStep]) -> object:
        """Enqueue one engine step (hot path: once per step). Only executors whose kernels.BACKENDS
        row has `speculates` get steps with num_spec > 0."""
        ...

    def collect(self, handle: object) -> StepOutput:
        """Wait for the launched step `handle` (the oldest not collected) -> its sampled ids."""
        ...

    def step(self, seqs: Sequence[SeqStep]) -> StepOutput:
        """`collect(launch(seqs))`."""
        ...

    def close(self) -> None:
        ...


class SyncExecutor:
    """The Executor's launch/collect for an executor whose `step` computes on the calling thread
    (the CPU model runner, test fakes): `launch` runs the step, `collect` returns it; nothing
    overlaps."""
    overlaps = False

    def launch(self, seqs: Sequence[SeqStep]) -> StepOutput:
        return self.step(seqs)

    @staticmethod
    def collect(handle: StepOutput) -> StepOutput:
        return handle
