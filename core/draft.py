"""The draft-model proposer: a second, smaller model with the same tokenizer proposes tokens.

Rules:
1. The draft runs through an `Executor` of its own (any backend row tokenwire can build, made
   by tokenwire/runtime.py) with its own KV blocks, counted by its own `BlockManager` (no
   prefix cache): one `DraftSeq` per speculating request, made at its first proposal.
2. `propose_many(reqs, ks)` runs the draft greedily for all of them at once: one step that
   feeds each request the tokens its draft cache lacks (the prompt on first use, later the
   tokens verified since; samples the first proposal), then up to max(ks) - 1 one-token
   steps, each request stopping at its own k. A proposal is the draft's argmax: a point mass,
   which the target's verification needs (core/speculative.py rule 3).
3. Rollback is lazy: a `DraftSeq` remembers the proposals it fed; at the next proposal the
   cache is trusted up to the first of them the request did not keep.
4. A request whose draft cache does not fit (blocks, the draft's context) proposes nothing
   that step. `release(req)` frees its draft blocks (finish, cancel, failure, preemption).

Hot path: once per step while requests speculate; the draft's steps are its own forwards.
"""

from typing import Sequence

from .block_manager import BlockManager
from .executor import Executor, SeqStep
from .sampling_params import SamplingParams

DRAFT_PARAMS = SamplingParams(temperature=0.0)      # proposals are the draft's argmax


class DraftSeq:
    """One request's state in the draft model's KV cache."""
    __slots__ = ("block_table", "num_computed", "fed_start", "fed")

    def __init__(self):
        self.block_table = []           # list[int]: the draft's KV blocks, in position order
        self.num_computed = 0           # positions whose K/V the draft cache holds
        self.fed_start = 0              # position of the first proposal fed to the draft last time
        self.fed = []                   # list[int]: the proposals fed then (verified lazily, rule 3)


class DraftProposer:
    looks_up = False                # proposing runs the draft: Speculator.plan weighs k first, then asks

    def __init__(self, executor: Executor, max_model_len: int):
        self.executor = executor
        self.max_model_len = max_model_len      # the draft's context
        self.block_manager = BlockManager(executor.num_blocks, executor.block_size)
        self.seqs = {}                  # request_id -> DraftSeq
        self.num_steps = 0              # draft executor steps run

    def propose(self, req, k: int) -> list:
        return self.propose_many([req], [k])[0]

    def propose_many(self, reqs: Sequence, ks: Sequence[int]) -> list:
        """-> one list of proposed ids per request (empty where the draft cannot run it)."""
        out = [[] for _ in reqs]
        live = []                       # (index, request, its DraftSeq, k) still proposing
        steps = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            seq = self._catch_up(req, k)
            if seq is not None:
                live.append((i, req, seq, k))
                num = req.num_tokens
                steps.append(SeqStep(req.request_id, req.tokens(seq.num_computed, num), seq.num_computed,
                                     seq.block_table, True, DRAFT_PARAMS, 0, (), ()))
                seq.fed_start, seq.fed, seq.num_computed = num, [], num
        while steps:
            ids = self.executor.step(steps).token_ids
            self.num_steps += 1
            steps, still = [], []
            for (i, req, seq, k), token in zip(live, ids):
                out[i].append(token)
                if len(out[i]) < k:
                    steps.append(SeqStep(req.request_id, (token,), seq.num_computed, seq.block_table, True,
                                         DRAFT_PARAMS, 0, (), ()))
                    seq.fed.append(token)
                    seq.num_computed += 1
                    still.append((i, req, seq, k))
            live = still
        return out

    def _catch_up(self, req, k: int):
        """The request's DraftSeq with its cache trimmed to what was verified and blocks for this
        proposal's positions, or None when they do not fit (then it holds none)."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = DraftSeq()
        elif seq.fed:
            kept = req.tokens(seq.fed_start, seq.fed_start + len(seq.fed))
            num = 0
            for fed, verified in zip(seq.fed, kept):
                if fed != verified:
                    break
                num += 1
            seq.num_computed = min(seq.num_computed, seq.fed_start + num)
        # the last token is fed again even when the draft computed it (its proposal was kept as
        # the target's own next token): its logits give the first proposal
        seq.num_computed = min(seq.num_computed, req.num_tokens - 1)
        end = req.num_tokens + k - 1                # positions the draft writes this time
        bm = self.block_manager
        if end > self.max_model_len or not bm.can_append_slot(seq.block_table, end):
            self.release(req)
            return None
        bm.append_slot(seq.block_table, end)
        return seq

    def release(self, req) -> None:
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None and seq.block_table:
            self.block_manager.free(seq.block_table)
