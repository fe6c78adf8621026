"""The TensorRT backend's Executor (core/executor.py): SeqSteps in, sampled ids out, TensorRT driving the model.

Contract:
- `TrtExecutor(config, options, manifest=, engine_fn=)` takes the GPU through the CUDA backend's driver
  (kernels/cuda/driver.py), makes a compute and a copy stream, loads (building once, cached:
  kernels/trt/engine.py) a decode and a prefill engine from the ONNX export
  (kernels/trt/onnx_export.py), and allocates every buffer once: the KV cache, step inputs,
  logits and ids, and a pinned host ring of `ring_slots` slots (kernels/cuda/ring.py's
  RingSlot). TensorRT writes into those buffers only (`set_tensor_address`).
- KV cache: one row of `max_len` positions per sequence, [max_batch, Hkv, max_len, hd] per
  layer for K and for V; the TensorScatter of the export updates it in place (present and
  past are bound to the same address). The scheduler sees it as `max_batch` blocks of
  `max_len - 1` tokens, so a sequence holds one block and its block id is its row; the last
  position of every row is scratch, where idle rows of a decode batch write.
- A step: every one-token sequence goes through the decode engine in one call over rows
  0..bucket-1 (the power of two above the highest live row; idle rows get a dummy token at
  the scratch position), replayed as a CUDA graph per bucket when `use_graphs`; every longer
  chunk through the prefill engine, one call per chunk, bound at its row. Inputs travel in
  one pinned staging buffer and three async copies; greedy ids come back from the graph's
  ArgMax (`next_token`) into the slot's pinned bytes on the copy stream; rows that need
  temperature, penalties or logprobs bring their logits back and are sampled by
  kernels/sampling.py, as the CPU backend does.
- `launch(seqs) -> handle` returns without waiting; `collect(handle)` waits (spin or blocking)
  on the slot's `ready` event and reads it; `on_ready(slot)` runs from a CUDA host function.
"""

import logging
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from ...core.config import ModelConfig
from ...core.executor import SeqStep, StepOutput
from ..cuda.driver import CudaDriver, capture_graph
from ..cuda.meta import needs_full_sampler
from ..cuda.ring import RingSlot
from ..sampling import sample

log = logging.getLogger(__name__)

ALIGNMENT = 256              # bytes: every address bound to TensorRT


def align(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class TrtOptions:
    max_batch: int = 64                 # sequences (KV rows) at once
    max_num_tokens: int = 2048          # tokens of one prefill chunk
    use_graphs: bool = True             # capture each decode bucket's enqueue in a CUDA graph
    ring_slots: int = 4
    wait: str = "spin"                  # "spin": poll the event; "block": sleep in the driver
    device: int = 0
    cache_dir: Optional[str] = None     # built plans; None: $TOKENWIRE_CACHE_DIR/trt (engine_build.resolve)

    def __post_init__(self):
        for name in ("max_batch", "max_num_tokens", "ring_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.wait not in ("spin", "block"):
            raise ValueError(f"wait must be spin or block, got {self.wait!r}")


class TrtHandle(NamedTuple):
    slot: int
    number: int                         # steps launched before this one
    out_at: list                        # per sampled SeqStep: ("decode", row) or ("chunk", j)
    bucket: int                         # decode rows run (0: none)
    num_chunks: int                     # prefill chunks run
    host_sampled: Optional[list]        # the sampled SeqSteps when kernels/sampling decides, else None


class TrtExecutor:
    # its token ids are staged from the host: a row fed the last step's token on the device
    # (SeqStep.num_pending) is not done yet, so the step driver does not overlap TensorRT steps
    overlaps = False

    def __init__(self, config: ModelConfig, options: TrtOptions = TrtOptions(), *, manifest: dict,
                 engine_fn: Callable, driver=None, on_ready: Optional[Callable[[int], None]] = None):
        """`engine_fn(graph, profile, device)` -> an engine with `.context()` (kernels/trt/engine.py's
        TrtEngine over engine_plan; tests pass kernels/trt/fake.py's)."""
        o = self.options = options
        self.config = c = config
        self.max_len = manifest["max_len"]
        if self.max_len < 2:
            raise ValueError("the export's max_len must be >= 2 (one position is the scratch slot)")
        self.block_size = self.max_len - 1          # the scheduler's block: one per sequence
        self.num_blocks = o.max_batch
        self.on_ready = on_ready
        self.drv = drv = driver if driver is not None else CudaDriver(o.device)
        self.compute_stream, self.copy_stream = drv.stream_create(), drv.stream_create()
        self.gpu = {"name": drv.name, "compute_capability": list(drv.compute_capability)}
        # every address bound to TensorRT is 256-byte aligned: decode entries first, then one
        # aligned stretch per prefill chunk (int64 words: 32 per 256 bytes; int32 and float32: 64)
        self.chunk_words = align(o.max_batch, 32)                     # where chunk ids / seq_lens start
        self.cap_tokens = align(self.chunk_words + o.max_num_tokens + 32 * o.max_batch, 32)
        self.cap_lens = self.chunk_words + 32 * o.max_batch
        self.chunk_ids = align(o.max_batch, 64)                       # where chunk next_tokens start (int32)
        self.cap_ids = self.chunk_ids + 64 * o.max_batch
        self.vocab_stride = align(c.vocab_size, 64)                   # chunk logits rows
        self._alloc()
        self.ring = [self._make_slot() for _ in range(o.ring_slots)]
        self.decode_engine = engine_fn("decode", self._profile(o.max_batch, 1, 1), self.gpu)
        self.prefill_engine = engine_fn("prefill", self._profile(1, 1, o.max_num_tokens), self.gpu)
        self.prefill_context = self.prefill_engine.context()
        self.decode_contexts = {}                                     # bucket -> (context, graph or None)
        self.graphs_enabled = o.use_graphs
        self.num_launched = self.num_waited = 0
        self._thread = threading.get_ident()
        drv.stream_synchronize(self.copy_stream)

    # ------------------------------------------------------------ allocation (once)

    def _alloc(self) -> None:
        c, o, drv = self.config, self.options, self.drv
        self.row_bytes = c.num_kv_heads * self.max_len * c.head_dim * 4            # one sequence, one layer, K or V
        if self.row_bytes % ALIGNMENT:
            raise ValueError(f"a KV row of {self.row_bytes} bytes is not a multiple of {ALIGNMENT}: export with a "
                             f"max_len that is a multiple of 64")
        self.cache_bytes = o.max_batch * self.row_bytes                              # [max_batch, Hkv, max_len, hd]
        self.kv_base = drv.mem_alloc(2 * c.num_layers * self.cache_bytes)
        drv.memset_async(self.kv_base, 2 * c.num_layers * self.cache_bytes, self.copy_stream)  # finite, never NaN
        self.meta_bytes = 8 * (2 * self.cap_tokens + self.cap_lens)
        self.meta = drv.mem_alloc(self.meta_bytes)      # int64: ids [cap_tokens], positions, seq_lens [cap_lens]
        self.meta_pos = self.meta + 8 * self.cap_tokens
        self.meta_lens = self.meta_pos + 8 * self.cap_tokens
        self.next_ids = drv.mem_alloc(4 * self.cap_ids)                            # int32 [cap_ids]
        self.logits = drv.mem_alloc(4 * o.max_batch * c.vocab_size)                # float32 [max_batch, V]: decode
        self.chunk_logits = drv.mem_alloc(4 * o.max_batch * self.vocab_stride)     # float32 [max_batch, Vp]: chunks

    def cache_ptr(self, layer: int, kind: str, row: int) -> int:
        """Address of row `row` of layer `layer`'s K ("key") or V ("value") cache."""
        index = 2 * layer + (kind == "value")
        return self.kv_base + index * self.cache_bytes + row * self.row_bytes

    def _make_slot(self) -> RingSlot:
        drv = self.drv
        o, V = self.options, self.config.vocab_size
        out = drv.host_alloc(4 * (self.cap_ids + o.max_batch * (V + self.vocab_stride)))  # ids, decode, chunk logits
        return RingSlot(drv.host_alloc(self.meta_bytes), out, drv.event_create(),
                        drv.event_create(blocking=self.options.wait == "block"))

    def _profile(self, max_batch: int, min_seq: int, max_seq: int) -> dict:
        """Input name -> (min, opt, max) dims of one engine's optimization profile."""
        c = self.config
        profile = {"input_ids": ((1, min_seq), (max_batch, min(max_seq, 16)), (max_batch, max_seq))}
        profile["positions"] = profile["input_ids"]
        profile["seq_lens"] = ((1,), (max_batch,), (max_batch,))
        cache = lambda b: (b, c.num_kv_heads, self.max_len, c.head_dim)            # noqa: E731
        for i in range(c.num_layers):
            for kind in ("key", "value"):
                profile[f"past_{kind}.{i}"] = (cache(1), cache(max_batch), cache(max_batch))
        return profile

    # ------------------------------------------------------------ the step (hot path)

    def step(self, seqs: Sequence[SeqStep]) -> StepOutput:
        """Run one engine step (hot path: once per step). Called from the engine thread only."""
        return self.collect(self.launch(seqs))

    def launch(self, seqs: Sequence[SeqStep]) -> TrtHandle:
        """Enqueue one step and return without waiting for the GPU (hot path)."""
        self._bind_thread()
        slot_index = self.num_launched % len(self.ring)
        slot = self.ring[slot_index]
        if slot.in_flight:
            raise RuntimeError(f"all {len(self.ring)} ring slots hold steps not yet collected; collect() the oldest first")
        if self.num_waited < self.num_launched:             # the previous step's ids may still be on their way
            self.drv.stream_wait_event(self.compute_stream, self.ring[(slot_index - 1) % len(self.ring)].ready)
        decode = [s for s in seqs if len(s.token_ids) == 1]
        chunks = [s for s in seqs if len(s.token_ids) > 1]
        self._check(seqs)
        staged = self._stage(slot, decode, chunks)
        bucket, out_at = staged["bucket"], staged["out_at"]
        decode_context = self._decode_context(bucket) if bucket else None   # first use captures: before our copy
        self._upload(slot, staged)
        if decode_context is not None:
            self._run_decode(*decode_context)
        for j, s in enumerate(chunks):
            self._run_prefill(s, staged["chunk_at"][j], j)
        rows = [s for s in seqs if s.sample]
        host_sampled = rows if rows and needs_full_sampler(rows) else None
        self._finish(slot, slot_index, bucket, len(chunks), host_sampled is not None)
        handle = TrtHandle(slot_index, self.num_launched, [out_at[id(s)] for s in rows], bucket, len(chunks),
                           host_sampled)
        self.num_launched += 1
        return handle

    def _check(self, seqs: Sequence[SeqStep]) -> None:
        """The limits of this executor, each failure named (TensorRT does not bounds-check)."""
        c, o = self.config, self.options
        for s in seqs:
            n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
            if n > o.max_num_tokens:
                raise ValueError(f"a prefill chunk of {n} tokens exceeds the TensorRT executor's max_num_tokens "
                                 f"{o.max_num_tokens}")
            if end > self.block_size:
                raise ValueError(f"position {end - 1} is past the export's KV capacity ({self.block_size} tokens)")
            if not s.block_table or not 0 <= s.block_table[0] < o.max_batch:
                raise ValueError(f"sequence {s.seq_id} has no KV row in [0, {o.max_batch})")
            if min(s.token_ids) < 0 or max(s.token_ids) >= c.vocab_size:
                raise ValueError(f"token id out of range [0, {c.vocab_size})")

    def _stage(self, slot: RingSlot, decode: Sequence[SeqStep], chunks: Sequence[SeqStep]) -> dict:
        """Fill the slot's pinned staging: decode rows at the start (fixed addresses: the decode
        graph replays), each chunk at its own aligned offset. -> offsets, and where each
        sampled sequence's id lands: ("decode", row) or ("chunk", j)."""
        ids, pos, lens = self._staging_views(slot)
        out_at = {}
        bucket = 0
        if decode:
            live = {s.block_table[0]: s for s in decode}
            if len(live) != len(decode):
                raise ValueError("two sequences of one step share a KV row")
            bucket = self._bucket(max(live) + 1)
            ids[:bucket], pos[:bucket], lens[:bucket] = 0, self.max_len - 1, self.max_len   # idle rows: scratch
            for row, s in live.items():
                ids[row], pos[row], lens[row] = s.token_ids[0], s.start_pos, s.start_pos + 1
                out_at[id(s)] = ("decode", row)
        t, chunk_at = self.chunk_words, []
        for j, s in enumerate(chunks):
            n = len(s.token_ids)
            ids[t:t + n] = s.token_ids
            pos[t:t + n] = np.arange(s.start_pos, s.start_pos + n)
            lens[self.chunk_words + 32 * j] = s.start_pos + n
            chunk_at.append(t)
            out_at[id(s)] = ("chunk", j)
            t = align(t + n, 32)
        used = (t, self.chunk_words + 32 * len(chunks)) if chunks else (bucket, bucket)
        return {"bucket": bucket, "out_at": out_at, "chunk_at": chunk_at, "num_tokens": used[0], "num_lens": used[1]}

    def _staging_views(self, slot: RingSlot) -> tuple:
        if not slot.views:
            T, L = self.cap_tokens, self.cap_lens
            words = slot.staging.view(np.int64)
            slot.views["meta"] = (words[:T], words[T:2 * T], words[2 * T:2 * T + L])
        return slot.views["meta"]

    def _upload(self, slot: RingSlot, staged: dict) -> None:
        T, L, stream = staged["num_tokens"], staged["num_lens"], self.compute_stream
        ids, pos, lens = self._staging_views(slot)
        self.drv.memcpy_htod_async(self.meta, ids, 8 * T, stream)
        self.drv.memcpy_htod_async(self.meta_pos, pos, 8 * T, stream)
        self.drv.memcpy_htod_async(self.meta_lens, lens, 8 * L, stream)

    def _bucket(self, num_rows: int) -> int:
        b = 1
        while b < num_rows:
            b *= 2
        return min(b, self.options.max_batch)

    def _run_decode(self, context, graph) -> None:
        if graph is not None:
            self.drv.graph_launch(graph, self.compute_stream)
        else:
            context.enqueue(self.compute_stream)

    def _run_prefill(self, s: SeqStep, token_at: int, j: int) -> None:
        """One chunk of one sequence at its KV row (shapes change per chunk: no graph)."""
        c, ctx, n, row = self.config, self.prefill_context, len(s.token_ids), s.block_table[0]
        for name in ("input_ids", "positions"):
            ctx.set_shape(name, (1, n))
        ctx.set_shape("seq_lens", (1,))
        ctx.bind("input_ids", self.meta + 8 * token_at)
        ctx.bind("positions", self.meta_pos + 8 * token_at)
        ctx.bind("seq_lens", self.meta_lens + 8 * (self.chunk_words + 32 * j))
        for i in range(c.num_layers):
            for kind in ("key", "value"):
                ctx.set_shape(f"past_{kind}.{i}", (1, c.num_kv_heads, self.max_len, c.head_dim))
                ctx.bind(f"past_{kind}.{i}", self.cache_ptr(i, kind, row))
                ctx.bind(f"present_{kind}.{i}", self.cache_ptr(i, kind, row))      # in place (KVCacheUpdate)
        ctx.bind("logits", self.chunk_logits + 4 * j * self.vocab_stride)
        ctx.bind("next_token", self.next_ids + 4 * (self.chunk_ids + 64 * j))
        ctx.enqueue(self.compute_stream)

    def _finish(self, slot: RingSlot, slot_index: int, bucket: int, num_chunks: int, with_logits: bool) -> None:
        """Ids (and logits when sampled on the host) to the slot's pinned bytes on the copy stream."""
        drv, copy, V = self.drv, self.copy_stream, self.config.vocab_size
        drv.event_record(slot.done, self.compute_stream)
        drv.stream_wait_event(copy, slot.done)
        num_ids = self.chunk_ids + 64 * num_chunks if num_chunks else bucket
        if num_ids:
            drv.memcpy_dtoh_async(slot.out, self.next_ids, 4 * num_ids, copy)
        if with_logits:
            decode_out, chunk_out = self._host_logits(slot)
            if bucket:
                drv.memcpy_dtoh_async(decode_out, self.logits, 4 * bucket * V, copy)
            if num_chunks:
                drv.memcpy_dtoh_async(chunk_out, self.chunk_logits, 4 * num_chunks * self.vocab_stride, copy)
        drv.event_record(slot.ready, copy)
        if self.on_ready is not None:
            drv.launch_host_func(copy, lambda i=slot_index: self.on_ready(i))
        slot.in_flight = True

    def _host_logits(self, slot: RingSlot) -> tuple:
        """The slot's pinned logits: (decode float32 [max_batch, V], chunks float32 [max_batch, Vp])."""
        o, V, Vp = self.options, self.config.vocab_size, self.vocab_stride
        floats = slot.out[4 * self.cap_ids:].view(np.float32)
        return floats[:o.max_batch * V].reshape(-1, V), floats[o.max_batch * V:].reshape(-1, Vp)

    def collect(self, handle: TrtHandle) -> StepOutput:
        """Block the calling (engine) thread until the step's ids are in the host ring."""
        if handle.number != self.num_waited:
            raise RuntimeError(f"steps must be collected in launch order: expected step {self.num_waited}, "
                               f"got {handle.number}")
        self._bind_thread()
        slot = self.ring[handle.slot]
        if self.options.wait == "spin":
            while not self.drv.event_query(slot.ready):
                pass
        else:
            self.drv.event_synchronize(slot.ready)
        if handle.host_sampled is None:
            ids = slot.out[:4 * self.cap_ids].view(np.int32)
            at = [i if kind == "decode" else self.chunk_ids + 64 * i for kind, i in handle.out_at]
            out = StepOutput(ids[at].tolist())
        else:
            decode, chunks = self._host_logits(slot)
            V = self.config.vocab_size
            logits = np.stack([decode[i] if kind == "decode" else chunks[i, :V] for kind, i in handle.out_at])
            out = sample(logits, handle.host_sampled)
        slot.in_flight = False
        self.num_waited += 1
        return out

    def _bind_thread(self) -> None:
        me = threading.get_ident()
        if me != self._thread:
            self.drv.make_current()
            self._thread = me

    # ------------------------------------------------------------ decode contexts and graphs

    def _decode_context(self, bucket: int) -> tuple:
        """The decode context of a bucket: shapes and addresses set once; its graph captured once."""
        entry = self.decode_contexts.get(bucket)
        if entry is not None:
            return entry
        c, ctx = self.config, self.decode_engine.context()
        for name in ("input_ids", "positions"):
            ctx.set_shape(name, (bucket, 1))
        ctx.set_shape("seq_lens", (bucket,))
        ctx.bind("input_ids", self.meta)
        ctx.bind("positions", self.meta_pos)
        ctx.bind("seq_lens", self.meta_lens)
        for i in range(c.num_layers):
            for kind in ("key", "value"):
                ctx.set_shape(f"past_{kind}.{i}", (bucket, c.num_kv_heads, self.max_len, c.head_dim))
                ctx.bind(f"past_{kind}.{i}", self.cache_ptr(i, kind, 0))
                ctx.bind(f"present_{kind}.{i}", self.cache_ptr(i, kind, 0))
        ctx.bind("logits", self.logits)
        ctx.bind("next_token", self.next_ids)
        graph = self._capture(ctx, bucket) if self.graphs_enabled else None
        self.decode_contexts[bucket] = (ctx, graph)
        return ctx, graph

    def _capture(self, ctx, bucket: int):
        """Run the context once on idle rows only (scratch positions: nothing live is touched), then
        capture its enqueue. A runtime that refuses capture leaves this bucket eager."""
        drv, stream = self.drv, self.compute_stream
        drv.stream_synchronize(self.copy_stream)
        for slot in self.ring:                              # nothing may be reading the shared step buffers
            if slot.in_flight:
                drv.event_synchronize(slot.ready)
        idle = np.zeros(3 * bucket, np.int64)
        idle[bucket:2 * bucket], idle[2 * bucket:] = self.max_len - 1, self.max_len
        for ptr, part in ((self.meta, idle[:bucket]), (self.meta_pos, idle[bucket:2 * bucket]),
                          (self.meta_lens, idle[2 * bucket:])):
            drv.memcpy_htod_async(ptr, part, 8 * bucket, stream)
        try:
            graph = capture_graph(drv, stream, ctx.enqueue)
        except Exception as exc:                            # TensorRT or the driver refused: stay eager
            log.warning("decode bucket %d runs without a CUDA graph: %s", bucket, exc)
            return None
        return graph

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free everything (waits for the device first)."""
        if self.drv is None:
            return
        drv = self.drv
        self._bind_thread()
        drv.stream_synchronize(self.compute_stream)
        drv.stream_synchronize(self.copy_stream)
        for _, graph in self.decode_contexts.values():
            if graph is not None:
                drv.graph_destroy(graph)
        for slot in self.ring:
            drv.host_free(slot.staging)
            drv.host_free(slot.out)
            drv.event_destroy(slot.done)
            drv.event_destroy(slot.ready)
        for ptr in (self.kv_base, self.meta, self.next_ids, self.logits, self.chunk_logits):
            drv.mem_free(ptr)
        for stream in (self.compute_stream, self.copy_stream):
            drv.stream_destroy(stream)
        self.decode_contexts, self.prefill_context, self.ring, self.drv = {}, None, [], None
