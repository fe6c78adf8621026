"""The engine: scheduler + executor + detokenizer behind a thread-safe submit/cancel API.

Contract (net/ builds on it):
- `add_request` and `cancel` are called on the event loop; they only validate, stamp and
  append to an inbox under a lock, then tell the step driver (core/step_driver.py), which
  wakes whoever runs the steps (`wake=False` and one `wake()` after a batch of submissions
  wakes it once). All scheduler state is touched by one thread at a time: the driver's (the
  engine thread, or the host's while the steps are lent), or whoever calls `step()` directly
  (tests, benchmarks, the warm-up).
  `add_choices` submits the n choices of one API request at once: the first leads, the
  others wait until its prompt is computed and share its blocks through the prefix cache.
- With `response_cache_size`, an exact repeat of a finished greedy or seeded answer is
  replayed at the start of the next step, without the scheduler or the model
  (core/response_cache.py).
- `step()` runs one synchronous step and returns one `StepTokens` (core/outputs.py): take the
  inbox and the cancellations, schedule, `executor.launch` then `collect`, append tokens,
  detokenize, check stops, free finished requests. Every output is a row; with `columns`
  (the server's choice, StepHost.columns), from COLUMNS_MIN_RUNNING running requests on, the
  common ones (one token, the request goes on) are columns instead.
- The halves of a step, for the driver's overlap: `begin_step()` takes the inbox, schedules
  and launches (-> an `InFlight`); `finish_step(in_flight)` collects its ids and applies them.
  A step may begin while the last one is in flight (core/scheduler.py, "Overlapped steps").
  `last_step_ns` is the executor time of the last step finished.
- `start()` / `shutdown()` / `is_alive()` are the driver's: a thread that steps while work
  exists and hands each step to the host net/ attached (`driver.attach(StepHost(...))`).
- Detokenization and stop strings run here, on the engine thread, because the scheduler must
  know at once that a request stopped (a deliberate change from docs/DESIGN's loop-side text).
- Warm-up: before `start()`, `warm_up(prompt ids, params, constraints)` runs requests to
  their end through `step()` on the calling thread, then forgets them: block accounting,
  prefix cache, scheduler, response cache and counters as built (tokenwire/runtime.py
  decides what a server runs before /health turns 200).
- Speculative decoding: with a `speculator` (core/speculative.py), the scheduler verifies
  proposed tokens inside the same step; a step may give one request several outputs, one
  per token, in order.
- Failures: an executor exception fails the running requests (finish_reason "error", with
  the message) and the thread goes on serving new ones; a cancelled request gets one final
  output with finish_reason "cancelled"; `shutdown()` fails whatever is left.
"""

import itertools
import logging
import os
import random
import threading
import time
from operator import attrgetter
from typing import NamedTuple, Optional, Sequence

from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .errors import InvalidRequest, PromptTooLong, QueueFull
from .executor import Executor
from .options import DEFAULTS
from .outputs import EngineStats, RequestOutput, StepTokens, Timeline
from .request import Request, RequestState
from .response_cache import ResponseCache
from .sampling_params import SamplingParams
from .scheduler import ScheduledStep, Scheduler
from .step_driver import StepDriver

log = logging.getLogger(__name__)
_sync_only = attrgetter("sync_only")
# columns apply from this many running requests: below it a step's few tokens save
# less than the columns' fixed cost (bench peers at concurrency 1 had +6-15 us TTFT with them)
COLUMNS_MIN_RUNNING = 8


def check_prompt(prompt_token_ids, max_model_len: int, vocab_size: int) -> list:
    """What a submission checks before it is queued (also an engine in another process's
    front end, tokenwire/engine_process.py). -> the prompt as a list; raises InvalidRequest
    or PromptTooLong."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequest("the prompt is empty: at least one token is needed")
    if len(prompt) >= max_model_len:
        raise PromptTooLong(len(prompt), max_model_len)
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    return prompt


class InFlight(NamedTuple):
    """A step `begin_step()` launched (or a step with nothing to launch: `plan` None)."""
    plan: Optional[ScheduledStep]       # the scheduler's step, None when nothing was launched
    handle: object                      # the executor's handle for collect()
    step: StepTokens                    # its outputs: rows so far (cancellations, replays); filled by finish_step
    columns: Optional[StepTokens]       # `step` when its common outputs go to columns, else None
    launched_ns: int                    # when executor.launch was called
    error: Optional[Exception] = None   # launch raised: finish_step fails the running requests (in
                                        # step order: a step in flight before it is applied first)


class EngineCore:
    def __init__(self, executor: Executor, tokenizer, *, eos_token_ids: Sequence[int], max_model_len: int,
                 max_num_seqs: int = DEFAULTS.max_num_seqs,
                 max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
                 max_queued_requests: int = DEFAULTS.max_queued_requests,
                 enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching, model_identity: Optional[str] = None,
                 response_cache_size: int = DEFAULTS.response_cache_size,
                 inline_step_ns: int = int(DEFAULTS.inline_step_us * 1000), speculator=None,
                 prefill_cap: int = 0, overlap: bool = True):
        config = executor.config
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        self.executor = executor
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len
        self.max_queued_requests = max_queued_requests
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)           # per-token tables built now, not on a request
        # the prefix cache's hash chains start from the model's identity (`model_identity`, else
        # its config): blocks of different models or precisions never match
        self._prefix_cache_identity = (model_identity or repr(config)) if enable_prefix_caching else None
        # every running request decodes each step, so the token budget also bounds the batch
        self._max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self._max_num_batched_tokens = max_num_batched_tokens
        self._prefill_cap = prefill_cap
        self._response_cache_size = response_cache_size
        self.speculator = speculator        # core/speculative.Speculator (its proposers), or None
        self._new_books()                   # block_manager, scheduler, response_cache, counters
        self.last_step_ns = 0               # the executor time of the last step finished (0: it ran none)
        self._last_done_ns = 0              # when the last step's ids came back
        self._lock = threading.Lock()       # inbox, cancellations, live ids; the driver's modes others read
        # who runs the steps (core/step_driver.py); overlap only where the executor's step overlaps
        self.driver = StepDriver(self, self._lock, overlap=overlap, inline_step_ns=inline_step_ns)
        self._inbox = []                    # list[Request], appended on the loop thread
        self._cancels = []                  # list[int] request ids, appended on the loop thread
        self._priorities = []               # list[(request id, priority)], appended on the loop thread
        self._live_ids = set()              # ids submitted and not yet finished (duplicate check)
        self._requests = {}                 # request_id -> Request; engine thread only
        # Seeds for requests that gave none: one PRNG seeded once from the OS, so a submission
        # costs no syscall. A request's stream is still its own (kernels/sampling.py).
        self._seeds = random.Random(int.from_bytes(os.urandom(16), "little"))
        self._stop_id_sets = {}             # (stop_token_ids, ignore_eos) -> frozenset; requests share them

    def _new_books(self) -> None:
        """The request-side state as built: KV block accounting (prefix cache included), the
        scheduler, the response cache, the arrival order and the counters (`__init__`; and
        `warm_up`, which forgets its requests this way)."""
        self.block_manager = BlockManager(self.executor.num_blocks, self.executor.block_size,
                                          prefix_cache_identity=self._prefix_cache_identity)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self._max_num_seqs,
                                   max_num_batched_tokens=self._max_num_batched_tokens,
                                   max_model_len=self.max_model_len, speculator=self.speculator,
                                   prefill_cap=self._prefill_cap)
        # exact-match answers replayed without the model (core/response_cache.py); 0: off
        self.response_cache = ResponseCache(self._response_cache_size) if self._response_cache_size else None
        self._arrival_seq = itertools.count()
        self.num_steps = 0
        self.num_scheduled = 0              # sequences in the last step
        self.num_tokens_generated = 0
        self.num_cancellations = 0

    # ------------------------------------------------------------------ event-loop side

    def add_request(self, request_id: int, prompt_token_ids: list, params: SamplingParams, timeline: Timeline,
                    priority: int = 0, wake: bool = True, constraint=None) -> None:
        """Submit a request (thread-safe). `priority`: smaller is served first, ties first come
        first served. `wake=False` leaves waking the engine thread to a later `wake()`, so a
        caller submitting several requests wakes it once, when done. `constraint`: a
        core/constraint.TokenConstraint the output must match. Raises QueueFull,
        PromptTooLong or InvalidRequest. (max_tokens beyond the context is capped here; the
        API routes refuse it before submitting.)"""
        prompt = self._check_prompt(prompt_token_ids)
        self._enqueue([self._request(request_id, prompt, params, timeline, priority, constraint)], wake)

    def add_choices(self, request_ids: Sequence[int], prompt_token_ids: list, params: Sequence[SamplingParams],
                    timelines: Sequence[Timeline], priority: int = 0, wake: bool = True) -> None:
        """Submit the n choices of one API request (n > 1) at once, all or none: one request per
        choice, with its own id, params (its own seed) and timeline. The first leads: the others
        wait until its prompt is computed and take its blocks from the prefix cache, computing
        only the last partial block again (their copy-on-write of it). Raises as add_request.
        (net/ refuses n > 1 with a constraint, so choices carry none.)"""
        prompt = self._check_prompt(prompt_token_ids)
        reqs = [self._request(rid, prompt, p, t, priority) for rid, p, t in zip(request_ids, params, timelines)]
        for follower in reqs[1:]:
            follower.leader = reqs[0]
        self._enqueue(reqs, wake)

    def _request(self, request_id: int, prompt: list, params: SamplingParams, timeline: Timeline,
                 priority: int, constraint=None) -> Request:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        spec = self.speculator
        sync_only = (constraint is not None or params.has_penalties
                     or (spec is not None and spec.speculates(params, constraint)))
        return Request(request_id, prompt, params, timeline, seed=seed, priority=priority,
                       arrival_seq=next(self._arrival_seq), max_model_len=self.max_model_len,
                       stop_token_ids=self._stop_ids(params), text_stream=self.detokenizer.stream(prompt, params),
                       constraint=constraint, sync_only=sync_only)

    def _enqueue(self, reqs: list, wake: bool, bounded: bool = True) -> None:
        """`bounded`: refuse past `max_queued_requests` (False: the warm-up's, which no client waits behind)."""
        with self._lock:
            num_queued = len(self._inbox) + self.scheduler.num_waiting
            if bounded and num_queued + len(reqs) > self.max_queued_requests:
                raise QueueFull(num_queued, self.max_queued_requests)
            for req in reqs:
                if req.request_id in self._live_ids:
                    raise InvalidRequest(f"request id {req.request_id} is already in use")
            queued_ns = time.monotonic_ns()
            for req in reqs:
                req.timeline.queued_ns = queued_ns
                self._live_ids.add(req.request_id)
            self._inbox += reqs
            wake_up = self.driver.wake_locked() if wake else None
        if wake_up is not None:             # outside the lock: the woken thread takes it first thing
            wake_up()

    def wake(self) -> None:
        """Get a step run if work is waiting (after `add_request(wake=False)`)."""
        if self._inbox:
            with self._lock:
                wake_up = self.driver.wake_locked()
            if wake_up is not None:
                wake_up()

    def _stop_ids(self, params: SamplingParams) -> frozenset:
        """EOS (unless ignore_eos) plus the request's stop ids, one shared set per combination."""
        key = (params.stop_token_ids, params.ignore_eos)
        ids = self._stop_id_sets.get(key)
        if ids is None:
            ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            if len(self._stop_id_sets) < 1024:      # bounded: clients choose the keys
                self._stop_id_sets[key] = ids
        return ids

    def _check_prompt(self, prompt_token_ids) -> list:
        return check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def cancel(self, request_id: int) -> None:
        """Thread-safe and idempotent; the request's blocks are free after the next step. An id
        not in flight is ignored now, not at the next step: a request submitted later under that
        id must not inherit the cancel."""
        with self._lock:
            if request_id not in self._live_ids:
                return
            self._cancels.append(request_id)
            wake_up = self.driver.wake_locked()
        if wake_up is not None:
            wake_up()

    def set_priority(self, request_id: int, priority: int) -> None:
        """Thread-safe: a submitted request's new priority (smaller first), applied at the next
        step; a finished or unknown id is ignored."""
        with self._lock:
            self._priorities.append((request_id, priority))

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """A step would do something: requests or cancellations to take, or requests running."""
        return bool(self._inbox or self._cancels) or self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting + len(self._inbox),
                           bm.num_used_blocks, bm.num_blocks, self.scheduler.num_preemptions,
                           self.num_cancellations, self.num_tokens_generated, self.num_steps, self.driver.is_alive(),
                           self.scheduler.num_prefix_queries, self.scheduler.num_prefix_hits, bm.num_cached_blocks,
                           self.response_cache.num_hits if self.response_cache is not None else 0,
                           *self._spec_counts())

    def _spec_counts(self) -> tuple:
        """(proposed, accepted, verifying request-steps) since start (EngineStats)."""
        spec = self.speculator
        return (spec.num_proposed, spec.num_accepted, spec.num_steps) if spec is not None else (0, 0, 0)

    # ------------------------------------------------------------------ engine side

    def step(self, columns: bool = False) -> StepTokens:
        """One synchronous step (hot path): `finish_step(begin_step(columns))`."""
        return self.finish_step(self.begin_step(columns))

    def step_or_fail(self, columns: bool = False) -> StepTokens:
        """`step()`, with a bug in core failing every request instead of raising: what the
        driver runs, and the warm-up (hot path: once per step)."""
        try:
            return self.step(columns)
        except Exception as e:
            log.exception("engine step raised; failing every request")
            return self.fail_everything(f"internal engine error: {type(e).__name__}: {e}")

    def begin_step(self, columns: bool = False) -> InFlight:
        """Take the inbox and the cancellations, schedule, launch (hot path: once per step).
        `columns`: the step's common outputs go to columns, from COLUMNS_MIN_RUNNING running
        requests on."""
        now_ns = time.monotonic_ns()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        outputs = []
        for req in inbox:
            if self.response_cache is not None:
                if self._replay(req, now_ns, outputs):
                    continue
                if req.leader is not None and req.leader.request_id not in self._requests:
                    req.leader = None       # its leader was replayed just before: nothing to wait for
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        if self._priorities:
            self._apply_priorities()
        if cancels:
            outputs += self._apply_cancels(cancels, now_ns)
        step = StepTokens(outputs)          # the executor's RequestOutputs join `outputs` in place (+=)
        in_columns = step if columns and self.scheduler.num_running >= COLUMNS_MIN_RUNNING else None
        plan = self.scheduler.schedule(now_ns)
        self.num_scheduled = len(plan.seqs)
        if not plan.seqs:
            return InFlight(None, None, step, None, now_ns)
        launched_ns = time.monotonic_ns()
        try:
            handle = self.executor.launch(plan.seqs)
        except Exception as e:
            return InFlight(None, None, step, None, launched_ns, e)
        return InFlight(plan, handle, step, in_columns, launched_ns)

    def finish_step(self, in_flight: InFlight) -> StepTokens:
        """Collect a launched step's ids and apply them: append, detokenize, stop, free
        (hot path: once per step). Steps finish in the order they began. -> its StepTokens"""
        plan, step = in_flight.plan, in_flight.step
        self.last_step_ns = 0
        if plan is not None:
            self.num_steps += 1             # steps the executor ran (cancellations alone are none)
            step.rows += self._collect(in_flight)
        elif in_flight.error is not None:
            step.rows += self._fail_running(in_flight.error)
        if self.scheduler.finished_ids:
            self._forget_finished()
        return step

    def failed_step(self, error: str) -> InFlight:
        """A step whose beginning raised (a bug in core): every request failed, nothing launched."""
        return InFlight(None, None, self.fail_everything(error), None, 0)

    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the last one's ids are applied: no
        running request's next row depends on the token just sampled (`Request.sync_only`)."""
        return not any(map(_sync_only, self.scheduler.running))

    def _apply_priorities(self) -> None:
        with self._lock:
            changes, self._priorities = self._priorities, []
        for request_id, priority in changes:
            req = self._requests.get(request_id)
            if req is not None and not req.is_finished and req.priority != priority:
                self.scheduler.reprioritize(req, priority)

    def _replay(self, req: Request, now_ns: int, outputs: list) -> bool:
        """Answer `req` from the response cache if it holds it: one output per token, as live.
        -> whether it did"""
        answer = self.response_cache.get(req)
        if answer is None:
            return False
        t = req.timeline
        t.first_scheduled_ns = t.finished_ns = now_ns
        t.response_cached = True
        num = len(answer.token_ids)
        t.step_done_ns.extend([now_ns] * num)
        for i, (token_id, text) in enumerate(zip(answer.token_ids, answer.texts)):
            outputs.append(RequestOutput(req.request_id, (token_id,), text, None,
                                         answer.finish_reason if i == num - 1 else None,
                                         req.num_prompt_tokens, i + 1, now_ns))
        self.num_tokens_generated += num
        with self._lock:
            self._live_ids.discard(req.request_id)
        return True

    def _apply_cancels(self, request_ids: list, now_ns: int) -> list:
        outputs = []
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is not None and not req.is_finished:
                outputs.append(self.scheduler.cancel(req, now_ns))
                self.num_cancellations += 1
        return outputs

    def _collect(self, in_flight: InFlight) -> list:
        plan = in_flight.plan
        try:
            result = self.executor.collect(in_flight.handle)
            done_ns = time.monotonic_ns()
            # a step launched while the last one ran started when that one's ids came back
            self.last_step_ns = done_ns - max(in_flight.launched_ns, self._last_done_ns)
            step_ns = result.busy_ns or done_ns - max(plan.scheduled_ns, self._last_done_ns)
            self._last_done_ns = done_ns
            if len(result.token_ids) != plan.num_samples:
                raise RuntimeError(f"the executor returned {len(result.token_ids)} token ids "
                                   f"for {plan.num_samples} sampling sequences")
        except Exception as e:
            return self._fail_running(e)
        columns = in_flight.columns
        outputs = self.scheduler.update(plan, result.token_ids, result.logprobs, done_ns, step_ns, columns)
        self.num_tokens_generated += len(outputs) + (len(columns.request_ids) if columns is not None else 0)
        return outputs

    def _fail_running(self, e: Exception) -> list:
        log.error("engine step failed; failing the %d running requests", self.scheduler.num_running, exc_info=e)
        return self.scheduler.fail_running(f"engine step failed: {type(e).__name__}: {e}", time.monotonic_ns())

    def _forget_finished(self) -> None:
        finished, self.scheduler.finished_ids = self.scheduler.finished_ids, []
        for request_id in finished:
            req = self._requests.pop(request_id)
            if self.response_cache is not None and req.state is RequestState.FINISHED:
                self.response_cache.put(req, self.detokenizer)
        with self._lock:
            self._live_ids.difference_update(finished)

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, prompt_token_ids: list, params: Sequence[SamplingParams], constraints: Sequence = ()) -> list:
        """Before `start()`: run one request per `params` (the i-th constrained by
        `constraints[i]`, when given) on `prompt_token_ids`, submitted together, to their end
        through `step()` on the calling thread: the executor's prefill and decode, sampling
        and the detokenizer, as a first request runs them (the executor's memory is touched,
        its lazy parts made). Then forget them (`_new_books`): the KV block accounting and
        prefix cache, scheduler, response cache and counters are as built; the request ids
        used (-1, -2, ...) are none a client ever gets. -> the requests' final RequestOutputs
        (finish_reason "error" with the message where one failed)."""
        if self.driver.is_alive():
            raise RuntimeError("warm_up runs before the engine thread starts")
        prompt = self._check_prompt(prompt_token_ids)
        constraints = list(constraints) or [None] * len(params)
        self._enqueue([self._request(-1 - i, prompt, p, Timeline(arrived_ns=time.monotonic_ns()), 0, constraint)
                       for i, (p, constraint) in enumerate(zip(params, constraints))], wake=False, bounded=False)
        finals = []
        while self.has_unfinished():
            finals += [out for out in self.step_or_fail().rows if out.finish_reason]
        self._new_books()
        return finals

    # ------------------------------------------------------------------ the driver's

    def start(self) -> None:
        """Step on the engine thread from now on (core/step_driver.py)."""
        self.driver.start()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the engine thread (after its current step), fail what is left, close the executor."""
        self.driver.stop(timeout)

    def is_alive(self) -> bool:
        return self.driver.is_alive()

    def fail_everything(self, error: str) -> StepTokens:
        """Fail every request, queued or running (shutdown, a bug in core). -> their final outputs"""
        now_ns = time.monotonic_ns()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for req in inbox:
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        outputs = self.scheduler.fail_all(error, now_ns)
        self._forget_finished()
        return StepTokens(outputs)
