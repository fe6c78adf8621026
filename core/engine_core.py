"""The engine: scheduler + executor + detokenizer behind a thread-safe submit/cancel API.

Contract (net/ builds on it):
- `add_request` and `cancel` are called on the event loop; they only validate, stamp and
  append to an inbox under a lock, then wake the engine thread if it sleeps (`wake=False`
  and one `wake()` after a batch of submissions wakes it once). All scheduler state is
  touched by the engine thread alone (or by whoever drives `step()` directly: tests, benchmarks).
  `add_choices` submits the n choices of one API request at once: the first leads, the
  others wait until its prompt is computed and share its blocks through the prefix cache.
- With `response_cache_size`, an exact repeat of a finished greedy or seeded answer is
  replayed at the start of the next step, without the scheduler or the model
  (core/response_cache.py).
- `step()` runs one synchronous step: take the inbox and the cancellations, schedule,
  `executor.step(seqs)`, append tokens, detokenize, check stops, free finished requests.
  It returns one `RequestOutput` per request that produced a token or ended; with
  `step_columns` set (the server sets it), a `StepTokens` instead: the same outputs, and
  from COLUMNS_MIN_RUNNING running requests on the common ones (one token, the request goes
  on) as columns (core/outputs.py). So the loop receives one step type.
- Step timing: with `step_times_ns` set to a deque, each executor step's duration (ns) is
  appended to it on the engine thread (the server's step-time histogram drains it).
- `start()` runs `step()` on a daemon thread while work exists and sleeps on a `Doorbell`
  otherwise; after each step with outputs it calls `on_step(outputs)` once — the single
  hand-off to the event loop per step (the server's rings a Doorbell the loop watches).
- Inline steps: with an `inline_host` set (the server's hand-off, net/writer/handoff.py), steps
  whose executor time is at most `inline_step_ns` run on the host's thread instead. A
  hand-off costs two context switches and four eventfd syscalls per step (~10-15 µs on a
  shared core): more than a zero-cost mock step or a tiny model's whole step. After
  INLINE_AFTER_SHORT_STEPS such steps in a row the engine thread lends its steps
  (`inline` becomes True, `inline_host.take_steps_threadsafe()`) and sleeps; the host then
  calls `step_or_fail()` and, after writing its outputs, `continue_inline()`, which gives the
  steps back to the engine thread after one longer executor step (a real model's steps
  are milliseconds and keep the thread: its kernels release the GIL, so the loop serves
  sockets meanwhile). While inline, `add_request` / `cancel` / `wake` ask the host for a
  step instead of ringing the thread; scheduler state is still touched by one thread at a
  time, and the host writes a step before it runs the next (no step ahead of the wire).
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
from typing import Callable, Optional, Sequence

from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .doorbell import Doorbell
from .errors import InvalidRequest, PromptTooLong, QueueFull
from .executor import Executor
from .options import DEFAULTS
from .outputs import EngineStats, RequestOutput, StepTokens, Timeline
from .request import Request, RequestState
from .response_cache import ResponseCache
from .sampling_params import SamplingParams
from .scheduler import Scheduler

log = logging.getLogger(__name__)
OnStep = Callable[[list], None]
# consecutive executor steps of at most inline_step_ns before the engine thread lends its steps
# to the inline host: one short step (a prefill chunk of a fast model) does not move them
INLINE_AFTER_SHORT_STEPS = 4
# step_columns applies from this many running requests: below it a step's few tokens save
# less than the columns' fixed cost (bench peers at concurrency 1 had +6-15 us TTFT with them)
COLUMNS_MIN_RUNNING = 8


class EngineCore:
    def __init__(self, executor: Executor, tokenizer, *, eos_token_ids: Sequence[int], max_model_len: int,
                 max_num_seqs: int = DEFAULTS.max_num_seqs,
                 max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens,
                 max_queued_requests: int = DEFAULTS.max_queued_requests, on_step: Optional[OnStep] = None,
                 enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching, model_identity: Optional[str] = None,
                 response_cache_size: int = DEFAULTS.response_cache_size,
                 inline_step_ns: int = int(DEFAULTS.inline_step_us * 1000), speculator=None,
                 prefill_cap: int = 0):
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
        self.on_step = on_step
        self.step_columns = False           # step() -> StepTokens instead of list[RequestOutput]
        self.step_times_ns = None           # a deque: each executor step's duration is appended (engine thread)
        self.inline_step_ns = inline_step_ns    # executor steps at most this long may run inline (0: never)
        self.inline_host = None             # runs short steps on its own thread (net/handoff.StepHandoff); None: never
        self.inline = False                 # the host runs the steps now; the engine thread sleeps (set under _lock)
        self._lock = threading.Lock()       # inbox, cancellations, live ids, the sleeping flag
        self._doorbell = Doorbell()         # rung to wake the engine thread when it sleeps
        self._inbox = []                    # list[Request], appended on the loop thread
        self._sleeping = False              # the engine thread waits on the doorbell (set under _lock)
        self._cancels = []                  # list[int] request ids, appended on the loop thread
        self._priorities = []               # list[(request id, priority)], appended on the loop thread
        self._live_ids = set()              # ids submitted and not yet finished (duplicate check)
        self._requests = {}                 # request_id -> Request; engine thread only
        # Seeds for requests that gave none: one PRNG seeded once from the OS, so a submission
        # costs no syscall. A request's stream is still its own (kernels/sampling.py).
        self._seeds = random.Random(int.from_bytes(os.urandom(16), "little"))
        self._stop_id_sets = {}             # (stop_token_ids, ignore_eos) -> frozenset; requests share them
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._close_on_exit = False         # shutdown() came from the engine thread itself

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
        self._num_short_steps = 0           # consecutive executor steps of at most inline_step_ns

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
        return Request(request_id, prompt, params, timeline, seed=seed, priority=priority,
                       arrival_seq=next(self._arrival_seq), max_model_len=self.max_model_len,
                       stop_token_ids=self._stop_ids(params), text_stream=self.detokenizer.stream(prompt, params),
                       constraint=constraint)

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
            ring = wake and self._sleeping
            if ring:
                self._sleeping = False
        if ring:                            # outside the lock: the woken thread takes it first thing
            self._doorbell.ring()
        elif wake and self.inline:
            self.inline_host.steps_wanted()

    def wake(self) -> None:
        """Wake the engine thread if it sleeps while work is waiting (after `add_request(wake=False)`)."""
        if self._sleeping and self._inbox:
            with self._lock:
                ring = self._sleeping
                self._sleeping = False
            if ring:
                self._doorbell.ring()
        elif self.inline and self._inbox:
            self.inline_host.steps_wanted()

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
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty: at least one token is needed")
        if len(prompt) >= self.max_model_len:
            raise PromptTooLong(len(prompt), self.max_model_len)
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return prompt

    def cancel(self, request_id: int) -> None:
        """Thread-safe and idempotent; the request's blocks are free after the next step. An id
        not in flight is ignored now, not at the next step: a request submitted later under that
        id must not inherit the cancel."""
        with self._lock:
            if request_id not in self._live_ids:
                return
            self._cancels.append(request_id)
            ring = self._sleeping
            self._sleeping = False
        if ring:
            self._doorbell.ring()
        elif self.inline:
            self.inline_host.steps_wanted()

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
                           self.num_cancellations, self.num_tokens_generated, self.num_steps, self.is_alive(),
                           self.scheduler.num_prefix_queries, self.scheduler.num_prefix_hits, bm.num_cached_blocks,
                           self.response_cache.num_hits if self.response_cache is not None else 0,
                           *self._spec_counts())

    def _spec_counts(self) -> tuple:
        """(proposed, accepted, verifying request-steps) since start (EngineStats)."""
        spec = self.speculator
        return (spec.num_proposed, spec.num_accepted, spec.num_steps) if spec is not None else (0, 0, 0)

    # ------------------------------------------------------------------ engine side

    def step(self) -> list | StepTokens:
        """One scheduler + executor step (hot path). -> list[RequestOutput], or StepTokens
        when `step_columns` is set (columns from COLUMNS_MIN_RUNNING running requests on)"""
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
        # with step_columns, every step is a StepTokens whose rows are `outputs` itself (the
        # executor's RequestOutputs join it in place, +=); its columns fill only from
        # COLUMNS_MIN_RUNNING running requests on
        step = StepTokens(outputs) if self.step_columns else None
        columns = step if step is not None and self.scheduler.num_running >= COLUMNS_MIN_RUNNING else None
        scheduled, seqs = self.scheduler.schedule(now_ns)
        self.num_scheduled = len(seqs)
        if seqs:
            outputs += self._run_executor(scheduled, seqs, columns)
        self.num_steps += 1
        if self.scheduler.finished_ids:
            self._forget_finished()
        return outputs if step is None else step

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

    def _run_executor(self, scheduled: list, seqs: list, columns: StepTokens | None) -> list:
        try:
            start_ns = time.monotonic_ns()
            result = self.executor.step(seqs)
            done_ns = time.monotonic_ns()
            step_ns = done_ns - start_ns
            if self.step_times_ns is not None:
                self.step_times_ns.append(step_ns)
            self._num_short_steps = self._num_short_steps + 1 if step_ns <= self.inline_step_ns else 0
            if len(result.token_ids) != self.scheduler.num_samples:
                raise RuntimeError(f"the executor returned {len(result.token_ids)} token ids "
                                   f"for {self.scheduler.num_samples} sampling sequences")
        except Exception as e:
            log.exception("engine step failed; failing the %d running requests", self.scheduler.num_running)
            return self.scheduler.fail_running(f"engine step failed: {type(e).__name__}: {e}", time.monotonic_ns())
        outputs = self.scheduler.update(scheduled, result.token_ids, result.logprobs, done_ns, columns)
        self.num_tokens_generated += len(outputs) + (len(columns.request_ids) if columns is not None else 0)
        return outputs

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
        if self._thread is not None:
            raise RuntimeError("warm_up runs before the engine thread starts")
        prompt = self._check_prompt(prompt_token_ids)
        constraints = list(constraints) or [None] * len(params)
        self._enqueue([self._request(-1 - i, prompt, p, Timeline(arrived_ns=time.monotonic_ns()), 0, constraint)
                       for i, (p, constraint) in enumerate(zip(params, constraints))], wake=False, bounded=False)
        finals = []
        while self.has_unfinished():
            step = self.step_or_fail()
            finals += [out for out in (step.rows if type(step) is StepTokens else step) if out.finish_reason]
        self._new_books()
        return finals

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._thread = threading.Thread(target=self._run, name="tokenwire-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        idle = False
        while self._wait_for_work(idle):
            outputs = self.step_or_fail()
            has_outputs = bool(outputs.rows or outputs.request_ids) if type(outputs) is StepTokens else bool(outputs)
            if has_outputs:         # no len(): a StepTokens' __len__ is a Python call, and this runs once per step
                self._deliver(outputs)
            idle = not has_outputs and not self.num_scheduled
            if self._num_short_steps >= INLINE_AFTER_SHORT_STEPS and self.inline_host is not None:
                self._lend_steps()
        last = self._fail_everything("the engine shut down")
        if len(last):
            self._deliver(last)
        if self._close_on_exit:
            self.executor.close()
            self._doorbell.close()

    def step_or_fail(self) -> list | StepTokens:
        """`step()`, with a bug in core failing every request instead of raising: what the
        engine thread runs, and the inline host (hot path: once per step)."""
        try:
            return self.step()
        except Exception as e:
            log.exception("engine step raised; failing every request")
            return self._fail_everything(f"internal engine error: {type(e).__name__}: {e}")

    def _wait_for_work(self, idle: bool) -> bool:
        """Block until there is something to do. -> False when shutting down. After a step
        that did nothing (it should not happen: a lone request always fits), wait 1 ms
        rather than spin."""
        if idle:
            self._doorbell.wait(0.001)
        while True:
            with self._lock:
                if self._stopping:
                    self._sleeping = False
                    return False
                if self._inbox or self._cancels or self.scheduler.has_unfinished():
                    self._sleeping = False
                    return True
                self._sleeping = True       # submitters ring only a sleeping thread: once per sleep
            self._doorbell.wait()

    def _deliver(self, outputs) -> None:
        """Hand one step's outputs to `on_step` (engine thread only: the inline host writes its own)."""
        if self.on_step is not None:
            try:
                self.on_step(outputs)
            except Exception:
                log.exception("on_step raised; the engine goes on")

    def _fail_everything(self, error: str) -> list:
        now_ns = time.monotonic_ns()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for req in inbox:
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        outputs = self.scheduler.fail_all(error, now_ns)
        self._forget_finished()
        return StepTokens(outputs) if self.step_columns else outputs

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop the thread (after its current step), fail what is left, close the executor."""
        with self._lock:
            self._stopping = True
            self.inline = False             # the host's thread calls this: it runs no step any more
        self._doorbell.ring()
        if self._thread is threading.current_thread():
            self._close_on_exit = True      # called from on_step: the loop ends after this step
            return
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %s s; the executor stays open", timeout)
                return
        else:
            self._fail_everything("the engine shut down")
        self.executor.close()
        self._doorbell.close()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ inline steps

    def _lend_steps(self) -> None:
        """Engine thread: the last steps were shorter than a hand-off; the host runs the next
        ones on its thread. Sleeps until they are given back (`continue_inline`) or shutdown."""
        with self._lock:
            if self._stopping:
                return
            self.inline = True
            self._sleeping = False          # submitters ask the host now, not this thread's doorbell
        self.inline_host.take_steps_threadsafe()
        while True:
            self._doorbell.wait()
            with self._lock:
                if not self.inline or self._stopping:
                    return

    def continue_inline(self, wrote: bool) -> bool:
        """Host thread, after an inline `step_or_fail()` and the writing of its outputs, if any
        (`wrote`) (hot path: once per step). -> whether the host should run another step now:
        True while work remains. False when none is left (a submission or a cancel asks
        again), and False after a step that gives the steps back to the engine thread: its
        executor step was longer than `inline_step_ns`, or it did nothing while work waits
        (the thread waits 1 ms after such a step rather than spin)."""
        if self.num_scheduled:
            if self._num_short_steps:
                return bool(self._inbox or self._cancels) or self.scheduler.has_unfinished()
        elif wrote or not self.has_work():
            return self.has_work()          # cancellations or replayed answers only; or idle
        with self._lock:
            self.inline = False
        self._num_short_steps = 0           # the thread lends them again after as many short steps
        self._doorbell.ring()
        return False
