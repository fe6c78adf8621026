"""Speculative decoding: a decoding request proposes its next k tokens, and one step verifies them.

Rules:
1. A proposer guesses a request's next tokens: `propose(req, k) -> list[int]` (at most k,
   maybe none), and `propose_many(reqs, ks)`, the same for several requests at once.
   `NgramProposer` (prompt lookup: the last n tokens matched against the prompt and the
   output, what followed them proposed) lives here; core/draft.py's `DraftProposer` runs a
   second, smaller model through the same executor machinery, with its own KV blocks.
2. `Speculator.plan` runs in `Scheduler.schedule()` once the decodes are scheduled: a
   speculating request's DecodeStep becomes (last token, d1 .. dm) with `num_spec = m`, the
   1 + m query rows of a prefill chunk; its KV blocks grow to cover them; the step's token
   budget pays m more. m is at most the request's k, never past max_tokens or the context,
   and 0 where blocks or budget lack. Requests with a grammar do not speculate (their mask
   would have to be computed along each proposal; they decode one token a step, as before).
3. The executor samples each of the 1 + m rows, row j as if d1 .. dj were already output
   (`sampling_rows`: its RNG counter and its penalties count them). `Speculator.accept`
   keeps the longest prefix of d1 .. dm equal to the rows' samples, and the sample after it
   (a correction, or a bonus token when all were accepted): a + 1 new tokens. Greedy: the
   argmax chain itself, token for token what decoding one at a time gives. Temperature > 0:
   a proposal is a point mass q = δ(d), for which the standard rule accepts d with
   probability min(1, p(d) / q(d)) = p(d) and on rejection draws from (p - q)+ normalized,
   i.e. p without d. Drawing t ~ p with the row's own uniform and accepting iff t == d does
   both with one number (P(t = d) = p(d); t given t != d is p without d, renormalized): the
   output is the target's distribution, and with a seed the very tokens sampling one at a
   time draws. (The draft model proposes its argmax, so its q is a point mass too.)
4. Rollback: the scheduler appends the a + 1 tokens one at a time (stops, min_tokens, stop
   strings, max_tokens as ever; a stop drops the rest); `num_computed_tokens` counts only
   verified positions, so a rejected proposal's KV slot is simply written again later; blocks
   past the verified end are freed; the prefix cache registers full blocks of computed
   tokens only, so never an unverified one.
5. Adaptive k (`SpecState.next_k`): each step, a request proposes the k (up to its maximum)
   that maximizes the expected tokens per unit of step time, (1 + r + ... + r^k) / (1 + f +
   k c): r is its moving acceptance (proposals kept / proposals decided), f + k c what
   verifying k rows adds to a decode step, learned from the steps themselves (`StepCosts`:
   on a GPU, or wherever a step is bound by reading the weights once, it is small and k stays
   high; where rows cost nearly a step, as for stories260K on the CPU, only a high acceptance
   pays). When no k promises MIN_GAIN, the request stops speculating for a pause that doubles
   each time (up to MAX_PAUSE decode steps; halved each time a k pays again), then proposes
   one token to measure again. A model whose output never repeats pays a one-row
   probe now and then.

No tensor library here: ints, lists, dicts.
"""

from typing import Optional, Sequence

from .executor import SeqStep
from .step_costs import EWMA_WEIGHT, FixedCosts, StepCosts  # noqa: F401 (FixedCosts: the tests' costs)

NGRAM_MIN = 2                   # shortest suffix matched (one token matched proposed half as well on stories260K)
NGRAM_MAX = 4                   # longest suffix matched (tried first)
MIN_GAIN = 1.05                 # expected tokens per unit of step time a k must promise over decoding alone
FIRST_PAUSE = 4                 # decode steps without proposals the first time no k pays
MAX_PAUSE = 256


class SpecState:
    """One request's speculation: its proposer, its acceptance, its pause, its counts."""
    __slots__ = ("proposer", "max_k", "num_kept", "num_tried", "pause", "num_paused", "probe", "history", "index",
                 "num_proposed", "num_accepted")

    def __init__(self, proposer, max_k: int):
        self.proposer = proposer            # None: this request does not speculate
        self.max_k = max_k
        # moving averages per verifying step: proposals kept, and proposals decided (the kept
        # ones and the one rejected, if any); kept / decided estimates the chance that each
        # next proposal is kept (1 before the first verification, which then sets them)
        self.num_kept = 0.0
        self.num_tried = 0.0
        self.pause = 0                      # length of the next pause, in decode steps (0: none yet)
        self.num_paused = 0                 # decode steps left in the current pause
        self.probe = False                  # the pause is over: propose one token to measure again
        self.history = None                 # NgramProposer: prompt + output as indexed so far
        self.index = None                   # NgramProposer: one dict per n: n-gram -> position after it
        self.num_proposed = 0
        self.num_accepted = 0

    def next_k(self, costs: tuple) -> int:
        """How many tokens to propose now (rule 5): the k in 0 .. max_k that maximizes the
        expected tokens per unit of step time, (1 + r + r^2 + ... + r^k) / (1 + fixed + k x
        per_row), with r = kept / decided and `costs` = (fixed, per_row), what verifying adds to
        a step over a decode step's time. 0 (no k promises MIN_GAIN): a pause, then a probe of
        one token."""
        fixed, per_row = costs
        if self.probe:
            self.probe = False
            return 1
        rate, gain, term = self.num_kept / self.num_tried if self.num_tried else 1.0, 1.0, 1.0
        best, best_value = 0, MIN_GAIN
        for k in range(1, self.max_k + 1):
            term *= rate
            gain += term
            value = gain / (1.0 + fixed + k * per_row)
            if value > best_value:
                best, best_value = k, value
        if not best:
            self.pause = min(MAX_PAUSE, 2 * self.pause) if self.pause else FIRST_PAUSE
            self.num_paused = self.pause
            self.probe = True
        elif self.pause:
            self.pause //= 2                # it pays again: a later pause starts shorter
        return best

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verifying step's outcome (rule 5)."""
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        weight = EWMA_WEIGHT if self.num_tried else 1.0
        self.num_kept += weight * (num_accepted - self.num_kept)
        self.num_tried += weight * (num_accepted + (num_accepted < num_proposed) - self.num_tried)


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (NGRAM_MAX down to NGRAM_MIN tokens)
    that occurred before, at its latest occurrence, proposes what followed it. An index per
    n (n-gram -> the position after its latest occurrence) grows by a few dict entries per
    token, so a lookup never scans the sequence. What follows is copied on past the end of
    the sequence into the proposal itself, so a loop of period p proposes k tokens, not p."""

    looks_up = True                 # proposing is a lookup: Speculator.plan asks before it weighs k

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        self.ns = range(max_n, min_n - 1, -1)

    def propose(self, req, k: int) -> list:
        """-> up to k proposed token ids (none when no suffix occurred before)."""
        history = self._indexed(req)
        end = len(history)
        for n, index in zip(self.ns, req.spec.index):
            if n >= end:
                continue
            pos = index.get(tuple(history[end - n:]))
            if pos is not None:
                out = history[pos:pos + k]
                while len(out) < k:             # the copy runs into the sequence's end: go on from the copy
                    out.append(out[len(out) - (end - pos)])
                return out
        return []

    def propose_many(self, reqs: Sequence, ks: Sequence[int]) -> list:
        return [self.propose(req, k) for req, k in zip(reqs, ks)]

    def _indexed(self, req) -> list:
        """The request's prompt + output, with every n-gram that has a next token indexed."""
        spec = req.spec
        history = spec.history
        if history is None:
            history = spec.history = list(req.prompt_token_ids)
            spec.index = [{} for _ in self.ns]
            old = 0
        else:
            old = len(history)
            history += req.output_token_ids[old - req.num_prompt_tokens:]
        for n, index in zip(self.ns, spec.index):      # positions old .. end - 1 gained an n-gram before them
            for pos in range(max(n, old), len(history)):
                index[tuple(history[pos - n:pos])] = pos
        return history

    def release(self, req) -> None:
        pass


class Speculator:
    """The engine's speculative decoding: its default method and k, the proposers, the counts."""

    def __init__(self, method: str, num_tokens: int, draft=None, max_rows: Optional[int] = None):
        self.method = method                # the server's: "ngram", "draft" or "off"
        # sampled rows a step may have, at most (the executor's `max_sample_rows`; None: any)
        self.max_rows = max_rows
        self.num_tokens = num_tokens        # the server's k
        self.proposers = {"ngram": NgramProposer()}
        if draft is not None:
            self.proposers["draft"] = draft
        self.num_proposed = 0               # counters since start (EngineStats)
        self.num_accepted = 0
        self.num_steps = 0                  # request-steps that verified proposals
        self.costs = StepCosts()            # what verifying costs (FixedCosts: decisions without timing)
        self.in_use = False                 # some request speculated: steps are timed from then on

    def state(self, req) -> SpecState:
        """A request's SpecState, made at its first decode from its params and the server's."""
        k = self._k(req.params)
        proposer = self._proposer(req.params, req.constraint)
        self.in_use = self.in_use or proposer is not None
        req.spec = SpecState(proposer, k)
        return req.spec

    def speculates(self, params, constraint) -> bool:
        """Whether a request of these params will get proposals."""
        return self._proposer(params, constraint) is not None

    def _k(self, params) -> int:
        return params.num_speculative_tokens if params.num_speculative_tokens is not None else self.num_tokens

    def _proposer(self, params, constraint):
        if not self._k(params) or constraint is not None:
            return None
        return self.proposers.get(params.speculative or self.method)

    def plan(self, decodes: list, budget: int, block_manager, num_running: int) -> int:
        """Give decoding requests their proposals (rule 2; once per step): within the token
        `budget` and, when the executor bounds a step's sampled rows, beside one row for each
        of the `num_running` requests. -> query rows added"""
        if self.max_rows is not None:
            budget = min(budget, self.max_rows - num_running)
        wanted, ks = {}, {}
        costs = self.costs.row_costs(len(decodes))
        num_rows = 0
        for req in decodes:
            spec = req.spec or self.state(req)
            if spec.proposer is None or budget <= 0:
                continue
            if spec.num_paused:
                spec.num_paused -= 1
                continue
            limit = min(spec.max_k, budget, req.max_total_tokens - req.num_tokens - 1)
            if limit <= 0:
                continue
            if spec.proposer.looks_up:      # a lookup first: a step without a match costs nothing more
                drafts = spec.proposer.propose(req, limit)
                k = min(spec.next_k(costs), len(drafts)) if drafts else 0
                if k:
                    added = self._extend(req, drafts[:k], block_manager)
                    num_rows += added
                    budget -= added
                continue
            k = min(spec.next_k(costs), limit)
            if k > 0:
                wanted.setdefault(spec.proposer, []).append(req)
                ks[req.request_id] = k
                budget -= k
        for proposer, reqs in wanted.items():    # proposers that run a model: all their requests at once
            for req, drafts in zip(reqs, proposer.propose_many(reqs, [ks[r.request_id] for r in reqs])):
                num_rows += self._extend(req, drafts, block_manager)
        return num_rows

    @staticmethod
    def _extend(req, drafts: list, block_manager) -> int:
        """Make `req`'s DecodeStep feed its proposals too, as far as free blocks allow. -> rows added"""
        step = req.decode_step
        start = step.start_pos
        fits = (len(req.block_table) + block_manager.num_free_blocks) * block_manager.block_size - start - 1
        num = min(len(drafts), fits)
        if num <= 0:
            return 0
        block_manager.append_slot(req.block_table, start + 1 + num)
        step.token_ids = (step.token_ids[0], *drafts[:num])
        step.num_spec = num
        return num

    def accept(self, req, drafts: Sequence[int], sampled: Sequence[int]) -> int:
        """Verify one request's proposals against its rows' samples (rule 3). -> how many of
        the proposals are kept (the caller appends that many + 1 of `sampled`)"""
        num = 0
        for proposed, got in zip(drafts, sampled):
            if proposed != got:
                break
            num += 1
        spec = req.spec
        spec.record(len(drafts), num)
        req.timeline.spec_proposed += len(drafts)
        req.timeline.spec_accepted += num
        self.num_proposed += len(drafts)
        self.num_accepted += num
        self.num_steps += 1
        return num

    def observe(self, num_decodes: int, num_rows: int, step_ns: int) -> None:
        """A pure decode step's time (the scheduler, once per step), with `num_rows` proposed rows."""
        self.costs.observe(num_decodes, num_rows, step_ns)

    def release(self, req) -> None:
        """`req` gave up its KV blocks (finish, cancel, failure, preemption): so does its proposer."""
        if req.spec is not None and req.spec.proposer is not None:
            req.spec.proposer.release(req)


def sampling_rows(seqs: Sequence[SeqStep]) -> list:
    """The rows a step samples, in order: each SeqStep with `sample`, followed for a speculating
    one by num_spec rows, row j of it sampling as if its first j proposals were output (their
    `output_token_ids` grown by them: the RNG counter and the penalties see them; a greedy
    row without penalties reads neither and shares the request's list). Executors sample
    these rows and return one token per row (hot path: without speculation, the plain list)."""
    if not any([s.num_spec for s in seqs]):
        return [s for s in seqs if s.sample]
    rows = []
    for s in seqs:
        if not s.sample:
            continue
        rows.append(s)
        num = s.num_spec
        if num:
            p = s.sampling
            plain = p.greedy and not p.has_penalties
            drafts = list(s.token_ids[len(s.token_ids) - num:])
            out = s.output_token_ids
            for j in range(1, num + 1):
                ids = out if plain else list(out) + drafts[:j]
                rows.append(SeqStep(s.seq_id, drafts[j - 1:j], s.start_pos + j, s.block_table, True, p, s.seed,
                                    s.prompt_token_ids, ids))
    return rows
