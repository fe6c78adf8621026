"""The CUDA backend's Executor (core/executor.py): SeqSteps in, sampled ids out, on one GPU.

Contract:
- `CudaExecutor(config, tensors, options)` takes one context on the device, makes a compute
  and a copy stream, loads the kernels (kernels/cuda/build.py) and allocates everything once:
  weights (kernels/cuda/weights.py), the paged KV cache (`num_blocks` of `block_size`, plus
  one scratch block for graph padding), activations for the largest step, step metadata,
  and a pinned host ring of `ring_slots` slots. No device allocation happens after __init__.
- `launch(seqs) -> StepHandle` enqueues a step and returns at once: the metadata goes from
  the slot's pinned staging to the device in one async copy; a decode step (one token per
  sequence, all sampling) replays the CUDA graph of its batch-size bucket, any other step
  launches the kernels eagerly; sampling runs on the device; the ids are copied
  asynchronously (copy stream) into the slot's pinned buffer and an event marks them ready.
- `collect(handle) -> StepOutput` waits for that event on the calling thread (the engine
  thread; never the event loop's) and reads the slot. `step(seqs)` is launch + collect.
  The wait is one cuEventSynchronize with the GIL released (kernels/cuda/driver.py): the
  driver spins for it (wait="spin", the lowest wake-up latency) or sleeps (wait="block");
  no Python polls the event and none runs in a CUDA host callback, so the event loop thread
  keeps the GIL while the GPU works. The engine thread's own hand-off to the loop (the step
  driver's StepHost.deliver, the server's eventfd Doorbell) follows the wait.
- Overlapped steps (core/step_driver.py): a step may be launched while the last one runs. A
  row with `num_pending` feeds the token the last step sampled for its sequence straight from
  the device: after the step's metadata is copied, `acts.tokens` (the last step's sampled ids,
  by row) is copied device to device into this step's token ids, one copy per run of rows
  whose source rows are consecutive (usually one run: the decode rows keep their order).
  The host never reads that token first; its RNG counter counts it (meta.fill_sampling).
- Ring slots are used in order; at most `ring_slots` steps may be launched and not yet
  collected, and they must be collected in launch order.
"""

import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from ...core.config import ModelConfig
from ...core.options import DEFAULTS
from ...core.executor import SeqStep, StepOutput
from ...core.speculative import sampling_rows
from .build import kernel_image
from .device import Device
from .driver import CudaDriver, capture_graph
from .forward import (LARGE_SPLIT, KVCache, StepGeometry, decode_splits, launch_step, make_activations,
                      matmul_workspace, plan_activations, queries_per_item)
from .kernels import MAX_TOP_LOGPROBS
from .meta import (check_eager, count_items, decode_layout, eager_layout, fill_decode, fill_eager, fill_sampling,
                   needs_full_sampler)
from .ring import RingSlot, read_step
from .weights import upload_weights

KV_DTYPES = {"float32": 4, "float16": 2}


@dataclass(frozen=True)
class CudaOptions:
    block_size: int = DEFAULTS.block_size
    num_blocks: Optional[int] = None        # None: kv_memory_fraction of the memory left after the rest
    kv_memory_fraction: float = 0.85
    kv_dtype: str = "float32"               # "float16" halves the cache; float32 matches the reference
    max_num_seqs: int = DEFAULTS.max_num_seqs                       # sequences per step
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens   # tokens per eager step (prefill chunk budget)
    max_model_len: Optional[int] = None     # None: min(max_position_embeddings, 8192)
    use_graphs: bool = True
    graph_batch_sizes: Optional[tuple] = None   # None: 1, 2, 4, ... up to max_num_seqs
    capture_at_start: bool = True           # capture the greedy decode graphs in __init__
    matmul: str = "auto"                    # "tc" (sm_80+), "simt", or auto
    activations: str = "exact"              # INT4 tensor-core products: "exact" (hi/lo fp16 pair) or "fp16"
    pdl: Optional[bool] = None              # programmatic dependent launch; None: on where the GPU has it (sm_90+)
    fused: bool = True                      # the fused decoder kernels (forward.py); False: the unfused reference
    split_size: int = 512                   # keys per attention split (multiple of 32)
    ring_slots: int = 4
    max_penalty_tokens: int = 1 << 18       # distinct prompt+output tokens of penalized rows per step
    wait: str = "spin"                      # in cuEventSynchronize, GIL released: "spin" in the driver, or "block" (sleep)
    timing_events: bool = False             # events that can be timed (benchmarks)
    # each step timed on the device (an event before its kernels, its `done` event timed): the
    # engine's cost model learns from StepOutput.busy_ns instead of the host's clock, which on a
    # busy host also counts the engine thread's wait for the GIL after the step
    step_timing: bool = True
    device: int = 0

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.matmul not in ("auto", "tc", "simt"):
            raise ValueError(f"matmul must be auto, tc or simt, got {self.matmul!r}")
        if self.activations not in ("exact", "fp16"):
            raise ValueError(f"activations must be exact or fp16, got {self.activations!r}")
        if self.wait not in ("spin", "block"):
            raise ValueError(f"wait must be spin or block, got {self.wait!r}")
        if self.split_size % 32 or self.split_size <= 0:
            raise ValueError(f"split_size must be a positive multiple of 32, got {self.split_size}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "ring_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class StepHandle(NamedTuple):
    slot: int
    number: int                 # steps launched before this one
    num_rows: int               # sampled ids this step returns
    logprobs: Optional[tuple]   # per row: N top logprobs asked for, or None; None when no row asked
    graph: bool                 # replayed a decode graph
    launched_ns: int


class CudaExecutor:
    overlaps = True

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], options: CudaOptions = CudaOptions(),
                 driver=None, image_fn: Callable[[str], bytes] = kernel_image):
        o = self.options = options
        self.config = c = config
        if c.head_dim > 256 or c.head_dim % 2:
            raise ValueError(f"the CUDA attention kernels take an even head_dim up to 256, the model has {c.head_dim}")
        self.drv = drv = driver if driver is not None else CudaDriver(o.device)
        pdl = o.pdl if o.pdl is not None else tuple(drv.compute_capability) >= (9, 0)
        self.dev = Device(drv, image_fn, pdl=pdl, max_head_dim=c.head_dim)
        self.matmul = ("tc" if self.dev.tensor_cores else "simt") if o.matmul == "auto" else o.matmul
        self.block_size = o.block_size
        self.max_model_len = o.max_model_len or min(c.max_position_embeddings, 8192)
        self.max_blocks = -(-self.max_model_len // o.block_size)         # block table width
        self.max_tokens = max(o.max_num_batched_tokens, o.max_num_seqs)
        # sampled rows a step may have (the sampler's buffers): speculation's verifying rows fit
        # beside the running sequences' one each (core/speculative.Speculator.max_rows)
        self.max_sample_rows = o.max_num_seqs
        self.qpi = queries_per_item(c)
        self.buckets = self._buckets()
        # attention splits of each decode graph, and of eager steps (max_model_len / split_size)
        self.decode_splits = {b: decode_splits(c, b, self.max_model_len, self.dev.num_sms) for b in self.buckets}
        self.eager_splits = -(-self.max_model_len // o.split_size)
        self.weights = upload_weights(self.dev, c, tensors, self.matmul, self.max_model_len, fused=o.fused)
        self.acts = self._alloc_activations()
        self.meta_bytes, self.meta = self._alloc_meta()
        self.kv = self._alloc_kv()
        self.num_blocks = self.kv.num_blocks
        self._limits = (c.vocab_size, self.max_model_len, self.num_blocks)   # what fill_decode checks
        self.ring = [self._make_slot() for _ in range(o.ring_slots)]
        a = self.acts                          # where each output lies in a slot's `out` bytes
        self._out_offsets = (a.token_logprob - a.tokens, a.top_ids - a.tokens, a.top_logprobs - a.tokens)
        self.graphs = {}                        # (bucket, mode) -> executable graph
        self._decode_layouts = {}               # bucket -> MetaLayout
        self.graphs_enabled = o.use_graphs      # a benchmark may switch to eager launches to profile
        self.num_launched = self.num_waited = 0
        self._last_handle: Optional[StepHandle] = None
        self._last_rows: Sequence[SeqStep] = ()  # the last launched step's sampled rows, in order
        self._thread = threading.get_ident()     # the thread the context is current on
        self.drv.stream_synchronize(self.dev.copy_stream)
        if o.use_graphs and o.capture_at_start:
            for b in self.buckets:
                self._graph(b, "greedy")

    # ------------------------------------------------------------ allocation (once)

    def _alloc_activations(self):
        o, drv, w = self.options, self.drv, self.weights
        linears = [lin for l in w.layers for lin in (l.qkv, l.o, l.gate_up, l.down)] + [w.lm_head]
        ws, counters = matmul_workspace(linears, self.max_tokens, self.dev.num_sms, o.activations)
        c = self.config
        ws_entries = max([b * c.num_heads * n for b, n in self.decode_splits.items()]
                         + [o.max_num_seqs * c.num_heads * self.eager_splits])
        plan = plan_activations(c, self.max_tokens, o.max_num_seqs, ws_entries, ws, counters)
        base = drv.mem_alloc(plan["_total"])
        drv.memset_async(base, plan["_total"], self.dev.copy_stream)     # padding columns and counters start at zero
        return make_activations(plan, base, self.max_tokens, o.max_num_seqs, ws_entries, o.activations)

    def _alloc_meta(self) -> tuple:
        o = self.options
        worst = eager_layout(self.max_tokens, o.max_num_seqs, o.max_num_seqs, self.max_blocks,
                             self.max_tokens + o.max_num_seqs, o.max_penalty_tokens)
        graph = decode_layout(o.max_num_seqs, self.max_blocks, o.max_penalty_tokens)
        nbytes = max(worst.nbytes, graph.nbytes)
        base = self.drv.mem_alloc(nbytes + 16 * o.max_num_seqs)
        # static attention work items of the decode graphs: row i is sequence i's one query
        self.static_items = base + nbytes
        # int32 [max_num_seqs]: the last step's sampled ids, kept while a graph capture runs the
        # kernels (and overwrites acts.tokens) before a step that feeds them (_launch_decode)
        self.kept_tokens = base + nbytes + 12 * o.max_num_seqs
        items = np.stack([np.arange(o.max_num_seqs), np.arange(o.max_num_seqs), np.ones(o.max_num_seqs)], 1).astype(np.int32)
        self._static_items_host = items
        self.drv.memcpy_htod_async(self.static_items, items, items.nbytes, self.dev.copy_stream)
        return nbytes, base

    def _alloc_kv(self) -> KVCache:
        c, o, drv = self.config, self.options, self.drv
        per_layer_block = o.block_size * c.num_kv_heads * c.head_dim * KV_DTYPES[o.kv_dtype]
        per_block = 2 * c.num_layers * per_layer_block
        num_blocks = o.num_blocks
        if num_blocks is None:
            free, _ = drv.mem_get_info()
            num_blocks = int(free * o.kv_memory_fraction) // per_block - 1
        if num_blocks < self.max_blocks:
            raise ValueError(f"a KV cache of {num_blocks} blocks of {o.block_size} tokens cannot hold one context "
                             f"of {self.max_model_len}; lower max_model_len or give the cache more memory")
        slots = (num_blocks + 1) * o.block_size                          # + the scratch block
        layer_bytes = slots * c.num_kv_heads * c.head_dim * KV_DTYPES[o.kv_dtype]
        base = drv.mem_alloc(2 * c.num_layers * layer_bytes)
        drv.memset_async(base, 2 * c.num_layers * layer_bytes, self.dev.copy_stream)
        k = tuple(base + (2 * i) * layer_bytes for i in range(c.num_layers))
        v = tuple(base + (2 * i + 1) * layer_bytes for i in range(c.num_layers))
        return KVCache(k, v, o.kv_dtype, o.block_size, num_blocks, num_blocks, base, 2 * c.num_layers * layer_bytes)

    def _make_slot(self) -> RingSlot:
        drv, o = self.drv, self.options
        out_bytes = self._out_bytes(o.max_num_seqs, logprobs=True)
        return RingSlot(drv.host_alloc(self.meta_bytes), drv.host_alloc(out_bytes),
                        drv.event_create(timing=o.timing_events or o.step_timing),
                        drv.event_create(timing=o.timing_events, blocking=o.wait == "block"),
                        start=drv.event_create(timing=True) if o.step_timing else None)

    def _out_bytes(self, rows: int, logprobs: bool) -> int:
        """Bytes from acts.tokens to copy back: the ids, or the ids and every logprob array."""
        a = self.acts
        return rows * 4 if not logprobs else (a.top_logprobs - a.tokens) + self.options.max_num_seqs * MAX_TOP_LOGPROBS * 8

    def _buckets(self) -> tuple:
        o = self.options
        if o.graph_batch_sizes:
            sizes = sorted(set(int(b) for b in o.graph_batch_sizes))
            if sizes[0] < 1 or sizes[-1] > o.max_num_seqs:
                raise ValueError(f"graph_batch_sizes must lie in [1, max_num_seqs={o.max_num_seqs}], got {sizes}")
            return tuple(sizes)
        sizes, b = [], 1
        while b < o.max_num_seqs:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [o.max_num_seqs])

    # ------------------------------------------------------------ the step (hot path)

    def step(self, seqs: Sequence[SeqStep]) -> StepOutput:
        """Run one engine step (hot path: once per step). Called from the engine thread only."""
        return self.collect(self.launch(seqs))

    def launch(self, seqs: Sequence[SeqStep]) -> StepHandle:
        """Enqueue one step and return without waiting for the GPU (hot path)."""
        start_ns = time.perf_counter_ns()
        self._bind_thread()
        slot_index = self.num_launched % len(self.ring)
        slot = self.ring[slot_index]
        if slot.in_flight:
            raise RuntimeError(f"all {len(self.ring)} ring slots hold steps not yet collected; collect() the oldest first")
        if self._last_handle is not None and self.num_waited < self.num_launched:
            # the previous step's ids may still be on their way to the host: keep acts.tokens
            self.drv.stream_wait_event(self.dev.compute_stream, self.ring[self._last_handle.slot].ready)
        rows = sampling_rows(seqs)          # 1 + num_spec per speculating sequence (core/speculative.py)
        if len(rows) > self.max_sample_rows:
            raise ValueError(f"a step of {len(rows)} sampled rows exceeds the CUDA executor's "
                             f"max_num_seqs {self.max_sample_rows}")
        bucket = self._decode_bucket(seqs)
        logprobs = None
        if any(s.sampling.logprobs is not None for s in rows):
            logprobs = tuple(s.sampling.logprobs for s in rows)
        if slot.start is not None:          # after the wait above: the step's own kernels are timed
            self.drv.event_record(slot.start, self.dev.compute_stream)
        if bucket:
            self._launch_decode(slot, seqs, bucket)
        elif seqs:
            self._launch_eager(slot, seqs, rows)
        self._finish(slot, len(rows), logprobs is not None)
        handle = StepHandle(slot_index, self.num_launched, len(rows), logprobs, bool(bucket), start_ns)
        self.num_launched += 1
        self._last_handle = handle
        self._last_rows = rows
        return handle

    def _bind_thread(self) -> None:
        """The context is current per thread: bind it once on whichever thread steps (the engine's)."""
        me = threading.get_ident()
        if me != self._thread:
            self.drv.make_current()
            self._thread = me

    def _decode_bucket(self, seqs: Sequence[SeqStep]) -> int:
        """The graph bucket for an all-decode step, or 0 for an eager step."""
        if not self.graphs_enabled or not seqs or len(seqs) > self.buckets[-1]:
            return 0
        if any(len(s.token_ids) != 1 or not s.sample for s in seqs):
            return 0
        return next(b for b in self.buckets if b >= len(seqs))

    def _decode_layout(self, bucket: int):
        layout = self._decode_layouts.get(bucket)
        if layout is None:
            layout = self._decode_layouts[bucket] = decode_layout(bucket, self.max_blocks, self.options.max_penalty_tokens)
        return layout

    def _launch_decode(self, slot: RingSlot, seqs: Sequence[SeqStep], bucket: int) -> None:
        o = self.options
        layout = self._decode_layout(bucket)
        views = slot.views.get(bucket)
        if views is None:
            views = slot.views[bucket] = layout.views(slot.staging)
        if slot.layout != bucket:
            slot.layout, slot.row_keys, slot.sampler_keys = bucket, [None] * bucket, [None] * bucket
        full = fill_decode(views, seqs, bucket, self.max_blocks, o.block_size, self.kv.scratch_block,
                           slot.row_keys, self._limits)
        entries = fill_sampling(views, seqs, o.max_penalty_tokens, slot.sampler_keys) if full else 0
        mode = "full" if full else "greedy"
        stream = self.dev.compute_stream
        fed_from = self.acts.tokens
        if (bucket, mode) not in self.graphs and any(s.num_pending for s in seqs):
            # the capture runs the kernels once, over acts.tokens: keep the last step's ids first
            self.drv.memcpy_dtod_async(self.kept_tokens, self.acts.tokens, 4 * len(self._last_rows), stream)
            fed_from = self.kept_tokens
        graph = self._graph(bucket, mode)         # first use captures: before our copy
        self.drv.memcpy_htod_async(self.meta, slot.staging, layout.used_bytes(full, entries), stream)
        self._feed_pending(seqs, layout.fields["token_ids"][0], fed_from)
        self.drv.graph_launch(graph, stream)

    def _launch_eager(self, slot: RingSlot, seqs: Sequence[SeqStep], rows: Sequence[SeqStep]) -> None:
        o, c = self.options, self.config
        T = sum(len(s.token_ids) for s in seqs)
        check_eager(seqs, T, self.max_tokens, o.max_num_seqs, self.max_model_len, self.max_blocks, o.block_size,
                    self.num_blocks, self.config.vocab_size)
        ld_bt = max(1, max(len(s.block_table) for s in seqs))
        num_items = count_items(seqs, self.qpi)
        layout = eager_layout(T, len(seqs), len(rows), ld_bt, num_items, o.max_penalty_tokens)
        views = layout.views(slot.staging)
        slot.layout = "eager"
        self._forget_tables(seqs)
        fill_eager(views, seqs, ld_bt, o.block_size, self.qpi)
        full = needs_full_sampler(rows)
        entries = fill_sampling(views, rows, o.max_penalty_tokens) if rows and full else 0
        stream = self.dev.compute_stream
        self.drv.memcpy_htod_async(self.meta, slot.staging, layout.used_bytes(bool(rows) and full, entries), stream)
        self._feed_pending(seqs, layout.fields["token_ids"][0], self.acts.tokens)
        max_ctx = max(s.start_pos + len(s.token_ids) for s in seqs)
        capacity = self.acts.ws_entries // (T * self.config.num_heads)     # splits the partials have room for
        if T == len(seqs):                  # decodes only: a decode graph's geometry (spread splits)
            splits, split_size = min(decode_splits(c, num_items, max_ctx, self.dev.num_sms), capacity), 0
        else:
            splits = 1 if max_ctx <= o.split_size else min(self.eager_splits, -(-max_ctx // o.split_size), capacity)
            split_size = o.split_size
        g = self._geometry(layout.ptrs(self.meta), T, len(rows), ld_bt, num_items, max(1, splits),
                           items=None, logits_rows=True, split_size=split_size)
        launch_step(self.dev, c, self.weights, self.acts, self.kv, g, "full" if full else "greedy", stream, o.fused)

    def _feed_pending(self, seqs: Sequence[SeqStep], token_ids_offset: int, sampled: int) -> None:
        """Rows with num_pending take the last step's sampled ids (int32 by row at `sampled`, on the
        device) after the metadata copy (hot path). They are decodes, and decodes come first:
        row i's token is token i."""
        last = None
        runs = []                           # [first row, first source row, length]
        for i, s in enumerate(seqs):
            if not s.num_pending:
                continue
            if last is None:
                last = {r.seq_id: j for j, r in enumerate(self._last_rows)}
            src = last[s.seq_id]
            if runs and runs[-1][1] + runs[-1][2] == src and runs[-1][0] + runs[-1][2] == i:
                runs[-1][2] += 1
            else:
                runs.append([i, src, 1])
        dst = self.meta + token_ids_offset
        for i, src, n in runs:
            self.drv.memcpy_dtod_async(dst + 4 * i, sampled + 4 * src, 4 * n, self.dev.compute_stream)

    def _forget_tables(self, seqs: Sequence[SeqStep]) -> None:
        """A prefilled sequence may hold new blocks (recompute after preemption): no graph
        bucket row may assume it still knows its block table."""
        ids = {s.seq_id for s in seqs}
        for slot in self.ring:
            slot.row_keys = [None if k is not None and k != "pad" and k[0] in ids else k for k in slot.row_keys]

    def _finish(self, slot: RingSlot, num_rows: int, logprobs: bool) -> None:
        """Ids to the slot's pinned buffer on the copy stream, then the events (hot path)."""
        drv, compute, copy = self.drv, self.dev.compute_stream, self.dev.copy_stream
        drv.event_record(slot.done, compute)
        drv.stream_wait_event(copy, slot.done)
        if num_rows:
            drv.memcpy_dtoh_async(slot.out, self.acts.tokens, self._out_bytes(num_rows, logprobs), copy)
        drv.event_record(slot.ready, copy)
        slot.in_flight = True

    def collect(self, handle: StepHandle) -> StepOutput:
        """Block the calling (engine) thread until the step's ids are in the host ring."""
        if handle.number != self.num_waited:
            raise RuntimeError(f"steps must be collected in launch order: expected step {self.num_waited}, "
                               f"got {handle.number}")
        self._bind_thread()
        slot = self.ring[handle.slot]
        self.drv.event_synchronize(slot.ready)          # GIL released for the whole wait
        out = read_step(slot, handle.num_rows, handle.logprobs, self._out_offsets)
        if slot.start is not None:          # both events completed before `ready` did
            out = out._replace(busy_ns=round(self.drv.event_elapsed_ms(slot.start, slot.done) * 1e6))
        slot.in_flight = False
        self.num_waited += 1
        return out

    # ------------------------------------------------------------ graphs

    def _geometry(self, ptrs: dict, T: int, R: int, ld_bt: int, num_items: int, splits: int,
                  items: Optional[int], logits_rows: bool, split_size: int) -> StepGeometry:
        return StepGeometry(
            num_tokens=T, num_rows=R, token_ids=ptrs["token_ids"], positions=ptrs["positions"],
            slot_mapping=ptrs["slot_mapping"], block_tables=ptrs["block_tables"], ld_bt=ld_bt,
            items=ptrs["items"] if items is None else items, num_items=num_items,
            logits_rows=ptrs["logits_rows"] if logits_rows else 0, num_splits=splits,
            split_size=split_size if splits > 1 else LARGE_SPLIT,
            dparams=ptrs["dparams"], fparams=ptrs["fparams"], iparams=ptrs["iparams"], rng=ptrs["rng"],
            pen_row_ptr=ptrs["pen_row_ptr"], pen_entries=ptrs["pen_entries"])

    def _graph(self, bucket: int, mode: str):
        """The decode graph of a bucket and sampler mode, captured on first use (once)."""
        graph = self.graphs.get((bucket, mode))
        if graph is not None:
            return graph
        o, drv, stream = self.options, self.drv, self.dev.compute_stream
        layout = self._decode_layout(bucket)
        g = self._geometry(layout.ptrs(self.meta), bucket, bucket, self.max_blocks, bucket, self.decode_splits[bucket],
                           items=self.static_items, logits_rows=False, split_size=0)
        # one eager run first: every row a padding row (scratch block), so nothing real is touched,
        # and every kernel has run once before capture
        pad = np.zeros(layout.nbytes, dtype=np.uint8)
        views = layout.views(pad)
        fill_decode(views, [], bucket, self.max_blocks, o.block_size, self.kv.scratch_block, [None] * bucket,
                    self._limits)
        fill_sampling(views, [], o.max_penalty_tokens)
        drv.memcpy_htod_async(self.meta, pad, layout.used_bytes(True, 0), stream)
        graph = capture_graph(drv, stream, lambda s: launch_step(self.dev, self.config, self.weights, self.acts,
                                                                self.kv, g, mode, s, o.fused))
        self.graphs[(bucket, mode)] = graph
        return graph

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free everything (waits for the device first)."""
        if self.drv is None:
            return
        drv = self.drv
        self._bind_thread()
        drv.stream_synchronize(self.dev.compute_stream)
        drv.stream_synchronize(self.dev.copy_stream)
        for graph in self.graphs.values():
            drv.graph_destroy(graph)
        for slot in self.ring:
            drv.host_free(slot.staging)
            drv.host_free(slot.out)
            drv.event_destroy(slot.done)
            drv.event_destroy(slot.ready)
            if slot.start is not None:
                drv.event_destroy(slot.start)
        for ptr in (self.weights.arena, self.acts.base, self.meta, self.kv.base):
            drv.mem_free(ptr)
        self.dev.close()
        self.graphs, self.ring, self.drv = {}, [], None
