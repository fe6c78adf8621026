"""Step-level continuous batching: which tokens of which requests go through the next step.

Policy, in the order `schedule()` applies it each step:
1. Decode: every DECODING request gets its one token, in priority order. When a block
   runs out, the lowest-priority newest running request is preempted (its blocks freed;
   it goes back to WAITING and later recomputes prompt + output), possibly the request itself.
2. Prefill: PREFILLING requests (oldest first) share what is left of the token budget
   (`max_num_batched_tokens`) in chunks, so a long prompt never holds up the decodes. A
   chunk short of blocks may preempt newer requests not scheduled this step, else shrinks.
   In a step that carries decodes, prefill chunks and admissions together take at most
   `prefill_cap` tokens (measured: core/step_costs.py keeps such a step within a quarter of a
   decode step of one), but never fewer than the floor of the prompt tokens pending
   (`prefill_floor`: a quarter of them, at most 16), so a prompt always moves and a backlog
   clears in about 4 steps; without decodes, the whole budget (a lone prompt's time to first
   token is unchanged).
3. Admit: waiting requests, smallest `priority` first then first come first served, while
   a sequence slot, the token budget and free blocks (above a small watermark) allow, and
   only in steps that preempted nothing. Head-of-line: a request that does not fit stops
   admission, so a big prompt cannot be starved by a stream of small ones.
   With the prefix cache on (core/prefix_cache.py), an admitted request takes the cached
   blocks of its longest cached prefix (never its last token: that one is fed, to be
   sampled) and is prefilled from there; its budget and block needs count only the rest;
   and the order is cache-aware within a bound: among the first 8 waiting requests of the
   head's priority the longest cached prefix goes first, the oldest passed over at most 4
   times (prefix_cache.py rule 4).
`schedule()` returns a `ScheduledStep`, and `update()` takes it back with the sampled ids: appends them, checks stop conditions (EOS / stop ids,
stop strings via the request's TextStream, max_tokens, context length; none of EOS, stop ids
and stop strings before the request's `min_tokens`) and frees finished
requests' blocks at once. Cancelled and failed requests free theirs when the engine
thread processes them, at the start of the next step.
Speculative decoding (core/speculative.py, with a `speculator`): once the decodes are
scheduled, decoding requests that speculate get proposals as extra query rows of their
DecodeStep (the budget pays them), and `update()` keeps the verified prefix of each, one
output per token, and frees the blocks past it.
Prefix cache: a block is registered under its content hash once every token in it is
computed: after a prefill chunk, and when a request releases its blocks (finish, cancel,
preemption: a preempted request usually finds its own prefix again). A decode's blocks are
registered then, all in one hash chain, not as each fills (SGLang's radix cache inserts a
request's decoded tokens when it finishes, too): what reads them is a later turn of the
conversation, which comes after the response; a block crossing is then one block append,
which the C loop takes. Never after a failed step: its device state is not trusted, and the
whole cache is forgotten then.

Overlapped steps (core/step_driver.py): the next step may be scheduled before the last one's
ids are back. A decoding request then has a token sampled and not appended (`num_pending`):
its decode feeds that token (the executor's own, SeqStep.num_pending) one position further,
and so does a request whose last prefill chunk is in flight (it decodes after it, as
synchronous steps would have it); one whose earlier chunk is in flight sits that step out.
`update()` of the earlier step skips the rows of requests that ended or were preempted
since it was scheduled: that token (one more than the request's last) is discarded, and its
blocks were freed when it ended (the device runs the steps in order, so a block freed while
a step writes it is reused only by a later step).

Invariants: a running request's `block_table` covers its cached tokens and its decode's next
position; `num_scheduled_tokens` is 0 outside a step (or while a prefill chunk is in flight).
No tensor library here: ints, lists, a heap. The two loops that run once per running
request per step (`_schedule_decodes`, `_append_tokens`) hand their common rows to C
(core/_rows.c) when it was built; their Python bodies are the whole behaviour, take every
row the C code leaves, and are what it is tested against (tests/test_rows_native.py).
"""

import bisect
import heapq
from operator import attrgetter
from typing import NamedTuple, Optional

from .block_manager import BlockManager
from .executor import SeqStep
from .outputs import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestOutput, StepTokens
from .prefix_cache import PrefixCache
from .step_costs import MAX_PREFILL_CHUNKS, MIN_PREFILL_TOKENS, StepCosts, prefill_floor
from .request import Request, RequestState
from .detokenizer import ByteTableDecoder

try:                                # the per-row loops' common case in C (core/_rows.c)
    from . import _rows as ROWS
except ImportError:                 # built without a compiler: the Python bodies take every row
    ROWS = None

WAITING, PREFILLING, DECODING = RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING
_sort_key = attrgetter("sort_key")
_new_tuple = tuple.__new__          # NamedTuple construction without the Python-level __new__ (hot path)


# the token_ids of a decode whose token is still in flight, as its prefill's only sample: a
# placeholder the executor does not read (SeqStep.num_pending)
PENDING_FEED = (0,)
GRAMMAR_BROKEN = "the sampled token breaks the request's grammar (the executor must mask constrained rows)"


class ScheduledStep(NamedTuple):
    """One step as `schedule()` made it: what `update()` needs once its ids are back (an
    overlapped step is updated after the next one is scheduled)."""
    requests: list                      # list[Request]: decodes first, then prefill chunks
    seqs: list                          # list[SeqStep]: theirs, in the same order
    num_samples: int                    # sampled rows: ids the executor returns
    num_decodes: int                    # the first `num_decodes` requests decode one token each
    num_spec_rows: int                  # proposed rows beyond one per decode
    num_prefill_tokens: int             # prompt tokens the step takes
    scheduled_ns: int                   # when schedule() began


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, watermark: float = 0.01, speculator=None, prefill_cap: int = 0):
        capacity = block_manager.num_blocks * block_manager.block_size
        if max_model_len > capacity:
            raise ValueError(f"max_model_len {max_model_len} does not fit the KV cache "
                             f"({block_manager.num_blocks} blocks x {block_manager.block_size} = {capacity} tokens)")
        if not 1 <= max_num_seqs <= max_num_batched_tokens:
            raise ValueError(f"need 1 <= max_num_seqs <= max_num_batched_tokens (every running request "
                             f"decodes each step), got {max_num_seqs} and {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting = []                   # heap of (priority, arrival_seq, Request)
        self.running = []                   # list[Request], sorted by sort_key
        self.num_preemptions = 0
        self.prefix_cache = PrefixCache(block_manager) if block_manager.enable_prefix_caching else None
        self.speculator = speculator        # core/speculative.Speculator, or None: no speculation
        # -1: measured (step_costs.py; what served engines use, EngineOptions.prefill_cap), 0: none
        # (an engine made here directly: its steps do not depend on the machine's timing), N: at most N
        self.prefill_cap = prefill_cap
        self._costs = StepCosts()           # the step cost model, unless the speculator holds it
        self._num_samples = 0               # sampled rows of the step being scheduled
        self._num_prefill_tokens = 0        # prompt tokens of the step being scheduled
        self.finished_ids = []              # request ids that ended since the owner last cleared this
        self.finished_now = []              # requests finished by the current update()
        self.rows = ROWS                    # core/_rows.c, or None: the Python loop bodies take every row

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_prefix_queries(self) -> int:
        return self.prefix_cache.num_queries if self.prefix_cache is not None else 0

    @property
    def num_prefix_hits(self) -> int:
        return self.prefix_cache.num_hits if self.prefix_cache is not None else 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        """Queue a request; a follower (another choice of an n > 1 request) waits on its leader
        while the leader's prompt is not computed yet, so the prefix cache shares it."""
        leader = req.leader
        if leader is not None and self.prefix_cache is not None and leader.state in (WAITING, PREFILLING):
            leader.followers.append(req)
            return
        heapq.heappush(self.waiting, (req.priority, req.arrival_seq, req))

    def _release_followers(self, req: Request) -> None:
        """`req`'s prompt is computed (or it ended): its followers join the queue."""
        followers, req.followers = req.followers, []
        for follower in followers:
            if not follower.is_finished:
                heapq.heappush(self.waiting, (follower.priority, follower.arrival_seq, follower))

    # ------------------------------------------------------------------ schedule

    def schedule(self, now_ns: int) -> ScheduledStep:
        """The next step (hot path: once per step); possibly while the last one runs (see
        "Overlapped steps")."""
        scheduled, seqs = [], []
        budget, num_preempted, prefilling = self._schedule_decodes(scheduled, seqs)
        num_decodes = self._num_samples = len(seqs)
        num_spec_rows = 0
        if self.speculator is not None and seqs:
            num_spec_rows = self.speculator.plan(scheduled, budget, self.block_manager, len(self.running))
            budget -= num_spec_rows
            self._num_samples += num_spec_rows
        self._num_prefill_tokens = 0
        if seqs and (prefilling or self.waiting):          # a step that carries decodes: capped prefill
            if self.prefill_cap >= 0:
                cap = self.prefill_cap
            else:
                cap = self.costs.prefill_cap(len(seqs))
                cap = cap and max(cap, prefill_floor(self._num_pending_prompt_tokens(prefilling)))
            if cap:
                budget = min(budget, cap)
        if prefilling and budget:
            budget, more = self._schedule_prefills(prefilling, budget, scheduled, seqs)
            num_preempted += more
        if not num_preempted and self.waiting and budget:
            self._admit(budget, now_ns, scheduled, seqs)
        return ScheduledStep(scheduled, seqs, self._num_samples, num_decodes, num_spec_rows,
                             self._num_prefill_tokens, now_ns)

    def _num_pending_prompt_tokens(self, prefilling: list) -> int:
        """The uncached prompt tokens of the prompts being prefilled or waiting, whole (not what
        is left of them: a prompt's floor stays put while it is computed, so it finishes in
        MAX_PREFILL_CHUNKS capped steps), counted up to what makes the largest floor (hot
        path: once per step that carries decodes and prompts; prefix lookups are memoized)."""
        enough, prefix_cache = MIN_PREFILL_TOKENS * MAX_PREFILL_CHUNKS, self.prefix_cache
        num = sum(req.num_tokens - req.num_cached_tokens for req in prefilling)
        for _, _, req in self.waiting:
            if num >= enough:
                break
            num += req.num_tokens
            if prefix_cache is not None:
                num -= len(prefix_cache.cached_prefix(req)) * self.block_manager.block_size
        return num

    @property
    def costs(self):
        """The step cost model (core/step_costs.py): the speculator's, which tests may replace,
        else the scheduler's own."""
        return self._costs if self.speculator is None else self.speculator.costs

    def _schedule_decodes(self, scheduled: list, seqs: list) -> tuple:
        """One token for every DECODING request (the loop body runs once per request per step).
        -> (budget left, preemptions, PREFILLING requests)"""
        running, bm = self.running, self.block_manager
        block_size, free_block_ids, evictable = bm.block_size, bm.free_block_ids, bm.evictable
        num_preempted, prefilling = 0, []
        add_scheduled, add_seq = scheduled.append, seqs.append
        fast = self.rows.schedule_decodes if self.rows is not None else None
        i = 0
        while i < len(running):             # _preempt_for pops from the end: the loop just stops sooner
            if fast is not None:            # C takes the rows that fit or get a free block; this body the others
                i = fast(running, i, scheduled, seqs, block_size, DECODING, free_block_ids, bm.ref_counts)
                if i == len(running):
                    break
            req = running[i]
            i += 1
            pending = req.num_pending
            if req.state is DECODING:
                start = req.num_computed_tokens + pending   # its pending token goes one position on
            elif pending:                   # its last prefill chunk is in flight: it decodes after it
                start = req.num_computed_tokens + req.num_scheduled_tokens
                req.decode_step.token_ids = PENDING_FEED
            else:
                prefilling.append(req)
                continue
            if pending and len(req.output_token_ids) + pending >= req.max_output_tokens:
                continue                    # its last token is in flight: it ends on it
            if start >= len(req.block_table) * block_size:     # its next token starts a new block
                if not free_block_ids and not evictable:
                    num_preempted += self._preempt_for(req)
                    if req.state is WAITING:
                        break               # it preempted itself: every newer request is gone too
                bm.append_block(req.block_table)
            add_scheduled(req)
            step = req.decode_step          # its token_ids were set when the token was appended
            step.start_pos = start
            step.num_pending = pending      # 1: the executor feeds the token it sampled last
            req.num_pending = pending + 1
            add_seq(step)
        return self.max_num_batched_tokens - len(seqs), num_preempted, prefilling

    def _preempt_for(self, req: Request) -> int:
        """Preempt the newest lowest-priority running requests until one block is free,
        `req` itself last. -> preemptions"""
        num_preempted = 0
        while not self.block_manager.can_allocate(1):
            victim = self.running[-1]
            self._preempt(victim)
            num_preempted += 1
            if victim is req:
                break
        return num_preempted

    def _schedule_prefills(self, prefilling: list, budget: int, scheduled: list, seqs: list) -> tuple:
        """Chunks for PREFILLING requests, oldest first. -> (budget left, preemptions)"""
        bm, num_preempted = self.block_manager, 0
        for req in prefilling:
            if not budget:
                break
            if req.state is not PREFILLING or req.num_scheduled_tokens:   # preempted earlier; or in flight
                continue
            start = req.num_computed_tokens
            num_tokens = min(req.num_tokens - start, budget)
            num_preempted += self._free_blocks_for(req, bm.num_new_blocks(req.block_table, start + num_tokens))
            fits = (len(req.block_table) + bm.num_free_blocks) * bm.block_size - start
            num_tokens = min(num_tokens, fits)
            if num_tokens <= 0:
                continue
            bm.append_slot(req.block_table, start + num_tokens)
            self._schedule_chunk(req, num_tokens, scheduled, seqs)
            budget -= num_tokens
        return budget, num_preempted

    def _free_blocks_for(self, req: Request, num_blocks: int) -> int:
        """Preempt requests newer than `req` that this step has not scheduled until `num_blocks`
        are free (or none is left). -> preemptions"""
        num_preempted = 0
        if self.block_manager.can_allocate(num_blocks):
            return 0
        for victim in reversed(self.running[:]):
            if self.block_manager.can_allocate(num_blocks) or victim is req:
                break
            if victim.state is PREFILLING and victim.num_scheduled_tokens == 0:   # decodes are all scheduled
                self._preempt(victim)
                num_preempted += 1
        return num_preempted

    def _admit(self, budget: int, now_ns: int, scheduled: list, seqs: list) -> None:
        """Admit waiting requests in order while the budget, the batch and the blocks allow.
        One pass per step for however many arrived: the heap is sorted in place first (a sorted
        list is still a heap; between steps only appends break the order, so the sort is
        linear), each admission then takes an entry from the front of that order, and no
        admission looks the queue over again (a wave of 64 arrivals was 64 heap selections)."""
        bm, waiting, running, prefix_cache = self.block_manager, self.waiting, self.running, self.prefix_cache
        if len(running) >= self.max_num_seqs:
            return
        waiting.sort()
        while waiting and budget and len(running) < self.max_num_seqs:
            i, cached = prefix_cache.pick(waiting) if prefix_cache is not None else (0, ())
            req = waiting[i][2]
            start = len(cached) * bm.block_size
            num_tokens = min(req.num_tokens - start, budget)
            reserve = self.watermark_blocks if running else 0
            num_needed = bm.num_blocks_for(start + num_tokens) - len(cached) + bm.num_evictable_in(cached)
            if num_needed + reserve > bm.num_free_blocks:
                break
            del waiting[i]                  # the rest stays sorted: still a heap
            req.transition(PREFILLING)
            if prefix_cache is not None:
                prefix_cache.take(req, cached)
            bm.append_slot(req.block_table, start + num_tokens)
            bisect.insort(running, req, key=_sort_key)
            if not req.timeline.first_scheduled_ns:
                req.timeline.first_scheduled_ns = now_ns
                req.num_cached_tokens = start
            self._schedule_chunk(req, num_tokens, scheduled, seqs)
            budget -= num_tokens

    def _schedule_chunk(self, req: Request, num_tokens: int, scheduled: list, seqs: list) -> None:
        start = req.num_computed_tokens
        end = start + num_tokens
        req.num_scheduled_tokens = num_tokens
        self._num_prefill_tokens += num_tokens
        sample = end == req.num_tokens
        self._num_samples += sample
        req.num_pending += sample
        scheduled.append(req)
        seqs.append(SeqStep(req.request_id, req.tokens(start, end), start, req.block_table, sample,
                            req.params, req.seed, req.prompt_token_ids, req.output_token_ids, req.constraint))

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the request's cache, send it back to the waiting heap."""
        if self.running and self.running[-1] is req:
            self.running.pop()
        else:
            self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.transition(WAITING)
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (req.priority, req.arrival_seq, req))

    def _release(self, req: Request, cache: bool = True) -> None:
        """Free the request's blocks, its computed full blocks cached first (`cache=False`
        after a failure: what the failed step wrote is not trusted)."""
        if req.block_table:
            if cache and self.prefix_cache is not None:
                self.prefix_cache.cache_computed(req, req.num_computed_tokens)
            self.block_manager.free(req.block_table)
            req.block_table.clear()
        req.num_hashed_blocks = 0
        req.num_scheduled_tokens = 0
        req.num_pending = 0                 # a step in flight samples for it: that token is discarded
        if req.spec is not None:
            self.speculator.release(req)

    # ------------------------------------------------------------------ update

    def update(self, step: ScheduledStep, sampled_ids, logprobs, now_ns: int, step_ns: int,
               columns: StepTokens | None = None) -> list:
        """Apply one step's results (hot path: once per step). Its requests start with the
        `num_decodes` decodes, one sampled id each; then come prefill chunks, and
        `sampled_ids[k]` belongs to the k-th chunk that reached its last token. `step_ns`: how
        long the step took (the cost model's sample). -> list[RequestOutput]
        `columns`: a token for a request that goes on goes there instead of into a RequestOutput
        (not when the step has logprobs: those are matched to the outputs by position)."""
        outputs = []
        if logprobs is not None:
            columns = None
        scheduled, num_decodes = step.requests, step.num_decodes
        decode_logprobs = None
        if num_decodes and (self.prefill_cap < 0 or (self.speculator is not None and self.speculator.in_use)):
            self.costs.observe(num_decodes, step.num_spec_rows, step.num_prefill_tokens, step_ns)
        if step.num_spec_rows:
            k, decode_logprobs = self._append_speculated(scheduled[:num_decodes], sampled_ids, logprobs, now_ns,
                                                         outputs, columns)
        else:
            if num_decodes:
                decodes = scheduled if len(scheduled) == num_decodes else scheduled[:num_decodes]
                self._append_tokens(decodes, sampled_ids, now_ns, outputs, columns)
            k = num_decodes
        if decode_logprobs is not None:
            logprobs = decode_logprobs + list(logprobs[k:])
        for req, seq in zip(scheduled[num_decodes:], step.seqs[num_decodes:]):
            if req.state is not PREFILLING:         # ended or preempted since the step was scheduled
                k += seq.sample
                continue
            computed = req.num_computed_tokens + req.num_scheduled_tokens
            req.num_scheduled_tokens = 0
            if self.prefix_cache is not None:
                self.prefix_cache.cache_computed(req, computed)
            if computed < req.num_tokens:
                req.num_computed_tokens = computed
                continue                    # a prefill chunk short of the end: nothing sampled
            req.num_computed_tokens = computed - 1      # _append_tokens counts the last token, as for a decode
            req.transition(DECODING)
            if req.followers:
                self._release_followers(req)
            self._append_tokens((req,), sampled_ids[k:k + 1], now_ns, outputs, columns)
            k += 1
        if logprobs is not None:
            self._attach_logprobs(outputs, logprobs)
        if self.finished_now:               # a few per step: list.remove scans in C, no property per request
            for req in self.finished_now:
                self.running.remove(req)
            self.finished_now.clear()
        return outputs

    def _append_speculated(self, decodes: list, sampled_ids, logprobs, now_ns: int, outputs: list,
                           columns: StepTokens | None) -> tuple:
        """The decodes of a step that verified proposals (core/speculative.py rules 3-4): a
        speculating request's 1 + m rows give it its accepted proposals and one more token,
        appended one at a time (a stop ends it there), each its own RequestOutput (never in
        `columns`, so its tokens stay in order); then its blocks past the verified end are
        freed. -> (index of the first prefill row in `sampled_ids`, the logprobs of the
        outputs made, in order, or None)"""
        kept = [] if logprobs is not None else None
        i = 0
        for req in decodes:
            step = req.decode_step
            num = step.num_spec
            if not num:
                self._append_tokens((req,), sampled_ids[i:i + 1], now_ns, outputs, columns)
                if kept is not None:
                    kept.append(logprobs[i])
                i += 1
                continue
            step.num_spec = 0
            rows = sampled_ids[i:i + 1 + num]
            num_new = self.speculator.accept(req, step.token_ids[1:], rows) + 1
            req.num_pending += num_new - 1  # one row, num_new tokens appended
            for j in range(num_new):
                self._append_tokens((req,), rows[j:j + 1], now_ns, outputs, None)
                if kept is not None:
                    kept.append(logprobs[i + j])
                if req.is_finished:
                    break
            else:
                self._free_unverified(req)
            i += 1 + num
        return i, kept

    def _free_unverified(self, req: Request) -> None:
        """Free the blocks past a request's next position (its rejected proposals' slots)."""
        bm = self.block_manager
        keep = bm.num_blocks_for(req.num_computed_tokens + 1)
        if len(req.block_table) > keep:
            bm.free(req.block_table[keep:])
            del req.block_table[keep:]

    def _append_tokens(self, reqs, sampled_ids, now_ns: int, outputs: list, columns: StepTokens | None) -> None:
        """Append one token to each request (its last fed token is now cached), stop or go on,
        and make its RequestOutput (or its entry in `columns`). The loop body runs once per
        generated token: hence the local names and the inline checks."""
        append = outputs.append
        fast = None
        if columns is not None:
            columns.step_done_ns = now_ns
            add_id, add_token, add_text = columns.request_ids.append, columns.token_ids.append, columns.texts.append
            if self.rows is not None:       # C takes the rows that go on plainly; this body the others
                fast = self.rows.append_tokens
        i, num = 0, min(len(reqs), len(sampled_ids))
        while i < num:
            if fast is not None:
                i = fast(reqs, sampled_ids, i, now_ns, columns.request_ids, columns.token_ids, columns.texts,
                         ByteTableDecoder)
                if i == num:
                    break
            req, token_id = reqs[i], sampled_ids[i]
            i += 1
            if not req.num_pending:
                continue                    # it ended (or was preempted) after the step was launched
            req.num_pending -= 1
            req.num_computed_tokens += 1
            output_ids = req.output_token_ids
            output_ids.append(token_id)
            num_output = len(output_ids)
            req.decode_step.token_ids = token_ids = (token_id,)  # this output's ids, and the next step's feed
            req.step_done_ns.append(now_ns)
            if token_id in req.stop_token_ids and num_output > req.params.min_tokens:
                finish, text = FINISH_STOP, ""      # the stop token's own text is not output
            else:                           # (before min_tokens a stop id is just a token)
                stream = req.text_stream
                text = stream.push(token_id)
                finish = FINISH_STOP if stream.stopped else \
                    FINISH_LENGTH if num_output >= req.max_output_tokens else None
                if req.constraint is not None and finish is None:
                    finish = self._advance_constraint(req, token_id)
            if finish is not None:
                text += req.text_stream.finish()
                if finish is FINISH_ERROR:
                    self._finish(req, RequestState.FAILED, finish, now_ns, GRAMMAR_BROKEN)
                else:
                    self._finish(req, RequestState.FINISHED, finish, now_ns)
                self.finished_now.append(req)
            elif columns is not None:
                add_id(req.request_id)
                add_token(token_id)
                add_text(text)
                continue
            append(_new_tuple(RequestOutput, (req.request_id, token_ids, text, None, finish, req.num_prompt_tokens,
                                              num_output, now_ns, req.error, req.num_cached_tokens)))

    @staticmethod
    def _advance_constraint(req: Request, token_id: int) -> Optional[str]:
        """The grammar takes the token (the sampler's mask allowed only tokens it takes); once
        nothing but EOS can follow, the output is complete: stop now rather than a step later.
        A token the grammar refuses (an executor that ignored the mask) fails the request."""
        if not req.constraint.accept(token_id):
            return FINISH_ERROR
        return FINISH_STOP if req.constraint.is_finished() else None

    @staticmethod
    def _attach_logprobs(outputs: list, logprobs) -> None:
        """The step's outputs are its sampled tokens, in order: give each its TopLogprobs, if any
        (rare: a second record only for the rows that asked)."""
        for i, lp in enumerate(logprobs):
            if lp is not None:
                outputs[i] = outputs[i]._replace(logprobs=(lp,))

    def _finish(self, req: Request, state: RequestState, reason: str, now_ns: int,
                error: Optional[str] = None) -> None:
        req.transition(state)
        self._release(req, cache=state is not RequestState.FAILED)
        if req.followers:
            self._release_followers(req)
        if req.constraint is not None:
            req.timeline.mask_ns = req.constraint.mask_ns
        req.finish_reason = reason
        req.error = error
        req.timeline.finished_ns = now_ns
        self.finished_ids.append(req.request_id)

    # ------------------------------------------------------------------ cancel / fail

    def reprioritize(self, req: Request, priority: int) -> None:
        """Give a live request a new priority: it takes its place in the waiting heap (admission)
        or the running order (preemption) at once. Rare (an HTTP/2 PRIORITY_UPDATE): O(n)."""
        req.priority = priority
        if req.state is WAITING:
            self.waiting = [(r.priority, r.arrival_seq, r) for _, _, r in self.waiting]
            heapq.heapify(self.waiting)
        else:
            self.running.sort(key=_sort_key)

    def cancel(self, req: Request, now_ns: int) -> RequestOutput:
        """Remove a live request wherever it is; its blocks are free when this returns."""
        self._remove(req)
        self._finish(req, RequestState.CANCELLED, FINISH_CANCELLED, now_ns)
        return self._final_output(req, now_ns)

    def fail(self, req: Request, error: str, now_ns: int) -> RequestOutput:
        self._remove(req)
        self._finish(req, RequestState.FAILED, FINISH_ERROR, now_ns, error)
        return self._final_output(req, now_ns)

    def fail_running(self, error: str, now_ns: int) -> list:
        """After a failed step: fail every running request, and forget the prefix cache (the
        device state the cached blocks describe is not trusted any more)."""
        outputs = [self.fail(req, error, now_ns) for req in list(self.running)]
        self.block_manager.reset_prefix_cache()
        return outputs

    def fail_all(self, error: str, now_ns: int) -> list:
        reqs = self.running + [entry[2] for entry in sorted(self.waiting)]
        reqs += [f for req in reqs for f in req.followers]
        for req in reqs:
            req.followers = []
        self.running, self.waiting = [], []
        outputs = []
        for req in reqs:
            self._finish(req, RequestState.FAILED, FINISH_ERROR, now_ns, error)
            outputs.append(self._final_output(req, now_ns))
        return outputs

    def _remove(self, req: Request) -> None:
        if req.state is WAITING and req.leader is not None and req in req.leader.followers:
            req.leader.followers.remove(req)
        elif req.state is WAITING:
            self.waiting = [entry for entry in self.waiting if entry[2] is not req]
            heapq.heapify(self.waiting)
        else:
            self.running.remove(req)

    @staticmethod
    def _final_output(req: Request, now_ns: int) -> RequestOutput:
        return RequestOutput(req.request_id, (), "", None, req.finish_reason, req.num_prompt_tokens,
                             len(req.output_token_ids), now_ns, req.error, req.num_cached_tokens)
