"""The forward pass and the sampler as sequences of kernel launches on one stream.

Contract:
- `Activations` (planned by `plan_activations`, one device allocation made by the executor)
  holds every intermediate buffer, sized once for the largest step: rows of `max_tokens`
  for the layers, `max_rows` for logits. Widths are padded to 128 columns and the padding
  is zero from the start and never written, as the INT4 kernels require.
- `launch_forward(dev, weights, acts, kv, geom, stream)` enqueues one whole step (embedding,
  every layer, final norm and lm_head for the rows that sample) without a host sync: the
  same code runs eager prefill steps and is captured into the decode CUDA graphs.
- `launch_sampler(dev, acts, geom, mode, stream)` enqueues sampling ("greedy": argmax only;
  "full": penalties, every sampling rule, logprobs) into `acts.tokens` etc.
- `launch_step(..., mode, fused)` is both. With `fused` (the default of CudaOptions) a decode
  layer is five kernels: qkv with RMSNorm folded into its prologue and RoPE + the KV append
  into its epilogue, attention with the split combine folded into its last split, o,
  gate_up with RMSNorm before and silu(g)*u (or GeGLU) after, down; a greedy step's argmax is
  folded into lm_head (with the final norm). Weights whose row order or kind does not allow a
  fusion (weights.py `rows`) take the unfused kernels, which stay as the fused ones' reference.
Shapes follow kernels/model.py: h [T, D] residual stream, qkv [T, Hq*hd + 2 Hkv*hd], ...
"""

import functools
from typing import NamedTuple, Optional

import numpy as np

from ...core.config import ModelConfig
from .device import attention_smem_bytes, sample_smem_bytes
from .kernels import (DENSE_MT, FUSED_NORM_TOKENS, MAX_TOP_LOGPROBS, MM_KERNELS, MM_ROWS, MM_VARIANTS, SIMT_MT,
                      fused_kernel, mm_kernel)
from .kernels import MM_BLOCKS_PER_SM as FAMILY_BLOCKS_PER_SM
from .layout import round_up
from .weights import ALIGN, DeviceWeights, Linear

LARGE_SPLIT = 1 << 30              # split_size when a step runs attention unsplit
# INT4 products split K to fill this many blocks per SM (decode of a matrix with few row blocks):
# None, each family's own (kernels.MM_BLOCKS_PER_SM: what its registers and shared memory let an
# SM hold), or one number for all; read at executor build (workspace) and at every launch, so set
# it before building. `bench engine --backend cuda --mm-blocks-per-sm N` sweeps it.
MM_BLOCKS_PER_SM: Optional[int] = None
# Split K to the most blocks one wave of them holds (rounding down), not the fewest that fill it
# (rounding up): at 2 a SM rounded up, the 8B gate_up at batch 1 ran 448 blocks where 3 a SM hold
# 396, a second wave 13% full. One wave of 3 took the 8B layer's products from 88.3 to 82.0 us
# (gate_up 48.5 -> 42.7; qkv 13.2 -> 15.9, the one that lost), each timed alone (H200,
# 2026-11-28). `bench engine --backend cuda --no-mm-one-wave`.
MM_ONE_WAVE = True
# Off (""), or an experiment: products by a variant's twin kernels (kernels.py MM_VARIANTS). Like
# MM_BLOCKS_PER_SM: set it before building an executor (`bench engine --backend cuda --mm-variant r`).
MM_VARIANT = ""


class KVCache(NamedTuple):
    k: tuple                        # per layer: [num_slots, Hkv, hd] device pointer
    v: tuple
    dtype: str                      # "float32" | "float16"
    block_size: int
    num_blocks: int                 # usable blocks (the scheduler's)
    scratch_block: int              # one more block, written by padding rows of a graph bucket
    base: int                       # the one allocation
    num_bytes: int


class Activations(NamedTuple):
    base: int
    num_bytes: int
    max_tokens: int
    max_rows: int
    ws_entries: int                 # (token, head, split) partials the attention workspace holds
    h: int; ld_h: int               # noqa: E702  fp32 [T, D]  residual stream
    xn: int; ld_xn: int             # noqa: E702  fp32 [T, D]  normed input of a projection
    qkv: int; ld_qkv: int           # noqa: E702  fp32 [T, q + 2kv]
    q: int; ld_q: int               # noqa: E702  fp32 [T, Hq*hd] rotated queries
    attn: int; ld_attn: int         # noqa: E702  fp32 [T, Hq*hd] attention output
    gu: int; ld_gu: int             # noqa: E702  fp32 [T, 2I]
    act: int; ld_act: int           # noqa: E702  fp32 [T, I]
    hn: int; ld_hn: int             # noqa: E702  fp32 [R, D]  final-normed rows that sample
    logits: int; plogits: int; ld_logits: int   # noqa: E702  fp32 [R, V] raw / penalized
    tokens: int                     # int32 [R]
    token_logprob: int              # float64 [R]
    top_ids: int                    # int32 [R, 20]
    top_logprobs: int               # float64 [R, 20]
    ws_ml: int                      # float2 [T, Hq, splits] of a split attention launch (ws_entries)
    ws_acc: int                     # fp32 [T, Hq, splits, hd]
    mm_ws: int                      # fp32 partials of K-split INT4 products (matmul_workspace)
    mm_counters: int                # int32 arrival counters of those products, zero between launches
    mm_mode: str                    # "exact" (fp32-level) or "fp16" activations in INT4 products
    am_keys: int = 0                # u64 [R] the argmax epilogue's best keys, zero between launches
    am_counters: int = 0            # int32 [R] its arrival counters per token tile, zero between launches
    att_counters: int = 0           # int32 [T * Hq] the fused attention's split counters, zero between launches


class StepGeometry(NamedTuple):
    """Device pointers and sizes of one step's metadata (hot path: built once per step)."""
    num_tokens: int                 # T
    num_rows: int                   # R: rows that sample (0: no lm_head)
    token_ids: int                  # int32 [T]
    positions: int                  # int32 [T]
    slot_mapping: int               # int32 [T]
    block_tables: int               # int32 [S, ld_bt]
    ld_bt: int
    items: int                      # int32 [num_items, 3] attention work items
    num_items: int
    logits_rows: int                # int32 [R] rows of T that sample, or 0: rows 0..R-1
    num_splits: int                 # attention splits along the sequence
    split_size: int
    dparams: int = 0                # sampler parameters (kernels/cuda/sampling.cu)
    fparams: int = 0
    iparams: int = 0
    rng: int = 0
    pen_row_ptr: int = 0            # int32 [R + 1]
    pen_entries: int = 0            # int32 [E, 2] (token, count in the output)


def plan_activations(c: ModelConfig, max_tokens: int, max_rows: int, ws_entries: int,
                     mm_ws_floats: int = 0, mm_counters: int = 0) -> dict:
    """name -> (offset, width) of every activation buffer; '_total' -> bytes."""
    w = lambda n: round_up(n, 128)                                      # noqa: E731
    rows = [("h", max_tokens, w(c.hidden_size), 4), ("xn", max_tokens, w(c.hidden_size), 4),
            ("qkv", max_tokens, w(c.q_size + 2 * c.kv_size), 4), ("q", max_tokens, w(c.q_size), 4),
            ("attn", max_tokens, w(c.q_size), 4), ("gu", max_tokens, w(2 * c.intermediate_size), 4),
            ("act", max_tokens, w(c.intermediate_size), 4), ("hn", max_rows, w(c.hidden_size), 4),
            ("logits", max_rows, w(c.vocab_size), 4), ("plogits", max_rows, w(c.vocab_size), 4),
            ("tokens", max_rows, 1, 4), ("token_logprob", max_rows, 1, 8),
            ("top_ids", max_rows, MAX_TOP_LOGPROBS, 4), ("top_logprobs", max_rows, MAX_TOP_LOGPROBS, 8),
            ("ws_ml", max(ws_entries, 1), 2, 4),
            ("ws_acc", max(ws_entries, 1), c.head_dim, 4),
            ("mm_ws", max(mm_ws_floats, 1), 1, 4), ("mm_counters", max(mm_counters, 1), 1, 4),
            ("am_keys", max_rows, 1, 8), ("am_counters", max_rows, 1, 4),
            ("att_counters", max(max_tokens, max_rows) * c.num_heads, 1, 4)]
    plan, offset = {}, 0
    for name, n, width, itemsize in rows:
        plan[name] = (offset, width)
        offset += round_up(n * width * itemsize, ALIGN)
    plan["_total"] = offset
    return plan


def make_activations(plan: dict, base: int, max_tokens: int, max_rows: int, ws_entries: int,
                     mm_mode: str = "exact") -> Activations:
    buffers = {name: v for name, v in plan.items() if name != "_total"}
    p = {name: base + off for name, (off, _) in buffers.items()}
    ld = {name: width for name, (_, width) in buffers.items()}
    return Activations(base, plan["_total"], max_tokens, max_rows, ws_entries,
                       p["h"], ld["h"], p["xn"], ld["xn"], p["qkv"], ld["qkv"], p["q"], ld["q"],
                       p["attn"], ld["attn"], p["gu"], ld["gu"], p["act"], ld["act"], p["hn"], ld["hn"],
                       p["logits"], p["plogits"], ld["logits"], p["tokens"], p["token_logprob"],
                       p["top_ids"], p["top_logprobs"], p["ws_ml"], p["ws_acc"], p["mm_ws"], p["mm_counters"],
                       mm_mode, p["am_keys"], p["am_counters"], p["att_counters"])


def heads_per_block(c: ModelConfig) -> int:
    """Query heads of one KV head that an attention block takes together (<= 16, divides the group)."""
    group = c.num_heads // c.num_kv_heads
    return max(d for d in range(1, min(group, 16) + 1) if group % d == 0)


def queries_per_item(c: ModelConfig) -> int:
    return 16 // heads_per_block(c)


def decode_splits(c: ModelConfig, num_items: int, max_keys: int, num_sms: int) -> int:
    """Attention splits for decode items (one query each) of up to `max_keys` keys: enough blocks for
    two per SM, so one long context is spread over the GPU, and no more than one per 32 keys. They
    run with split_size 0 (attention.cu): each item spreads its own keys over the splits, so a decode
    graph (its grid fixed at capture, for max_model_len) spreads a short context as well as a long."""
    per_split = num_items * c.num_kv_heads * (c.num_heads // c.num_kv_heads // heads_per_block(c))
    return max(1, min(-(-2 * num_sms // per_split), -(-max_keys // 32)))


# ------------------------------------------------------------------ launches

class MatmulPlan(NamedTuple):
    kernel: str
    tokens: int                     # tokens per tile of the kernel
    grid: tuple                     # (row blocks, token tiles, K splits)
    units_per_split: int            # 128-wide K units per block
    ws_floats: int                  # K-split partials it needs (0: no split)
    counters: int


def matmul_plan(lin: Linear, M: int, num_sms: int, mode: str) -> MatmulPlan:
    """Tensor-core kernel, grid and K split for an INT4 product of M tokens: enough blocks for
    MM_BLOCKS_PER_SM a SM, splitting K when the rows alone are too few (decode of a small matrix).
    (Hot path: every eager product; remembered per shape and knob setting.)"""
    return _matmul_plan(lin.N, lin.Kp, lin.group_size, M, num_sms, mode, MM_BLOCKS_PER_SM, MM_VARIANT,
                        MM_ONE_WAVE)


@functools.lru_cache(maxsize=4096)
def _matmul_plan(N: int, Kp: int, group_size: int, M: int, num_sms: int, mode: str, blocks_per_sm: Optional[int],
                 variant: str, one_wave: bool) -> MatmulPlan:
    tokens, family = next(((t, k) for t, k in MM_KERNELS[mode] if M <= t), MM_KERNELS[mode][-1])
    blocks_per_sm = blocks_per_sm or FAMILY_BLOCKS_PER_SM.get(family, FAMILY_BLOCKS_PER_SM[""])
    kernel = mm_kernel(family, group_size)
    Np, num_units = round_up(N, MM_ROWS), Kp // 128
    row_blocks, tiles = Np // MM_ROWS, -(-M // tokens)
    blocks, target = row_blocks * tiles, blocks_per_sm * num_sms
    ksplit = 1 if blocks >= target else min(num_units, target // blocks if one_wave else -(-target // blocks))
    kernel = MM_VARIANTS[variant].get(kernel, kernel) if variant else kernel
    ups = -(-num_units // ksplit)
    ksplit = -(-num_units // ups)
    if ksplit == 1:
        return MatmulPlan(kernel, tokens, (row_blocks, tiles, 1), ups, 0, 0)
    return MatmulPlan(kernel, tokens, (row_blocks, tiles, ksplit), ups, ksplit * tiles * tokens * Np,
                      row_blocks * tiles)


def matmul_workspace(linears, max_tokens: int, num_sms: int, mode: str) -> tuple:
    """(partial floats, counters) the largest K-split product of any weight and step size needs."""
    ws = counters = 0
    for lin in {(l.N, l.Kp): l for l in linears if l.kind == "int4_tc"}.values():
        for M in range(1, max_tokens + 1):
            plan = matmul_plan(lin, M, num_sms, mode)
            ws, counters = max(ws, plan.ws_floats), max(counters, plan.counters)
    return ws, counters


def launch_matmul(dev, lin: Linear, x: int, ldx: int, M: int, y: int, ldy: int, accumulate: bool,
                  acts: Activations, stream) -> None:
    """y[M, N] (+)= x[M, K] W^T (+ bias) with the kernel for the weight's kind and M."""
    assert ldx >= lin.Kp, f"{lin.name}: activation width {ldx} < padded K {lin.Kp}"
    common = dict(x=x, ldx=ldx, M=M, bias=lin.bias, y=y, ldy=ldy, N=lin.N, accumulate=int(accumulate))
    if lin.kind == "int4_tc":
        plan = matmul_plan(lin, M, dev.num_sms, acts.mm_mode)
        dev.launch(plan.kernel, plan.grid, 256, stream, **common, qw=lin.w, sz=lin.aux, num_units=lin.Kp // 128,
                   group_size=lin.group_size, units_per_split=plan.units_per_split, ws=acts.mm_ws,
                   counters=acts.mm_counters)
    elif lin.kind == "int4_simt":
        dev.launch("int4_mm_simt", (-(-lin.N // 4), -(-M // SIMT_MT)), 128, stream, **common,
                   qweight=lin.w, scales=lin.aux, zeros=lin.zeros, words_per_row=lin.Kp // 8,
                   group_size=lin.group_size)
    else:
        name = {"dense_f32": "dense_mm_f32", "dense_f16": "dense_mm_f16", "dense_i8": "dense_mm_i8"}[lin.kind]
        dev.launch(name, (-(-lin.N // 4), -(-M // DENSE_MT)), 128, stream, **common,
                   w=lin.w, ldw=round_up(lin.K, 8), row_scales=lin.aux)


# the fused products' extra parameters (kernels.py _MATMUL_FUSED), all unused
_FUSED_NONE = dict(positions=0, slot_mapping=0, cos_sin=0, max_positions=0, q_out=0, ldq=0, k_cache=0, v_cache=0,
                   num_heads=0, num_kv_heads=0, head_dim=0, argmax_keys=0, argmax_counters=0, tokens=0)


def launch_matmul_fused(dev, c: ModelConfig, lin: Linear, epilogue: str, x: int, ldx: int, M: int, y: int, ldy: int,
                        norm_w: int, acts: Activations, stream, **extra) -> None:
    """y = epilogue(rmsnorm(x) * norm_w @ W^T (+ bias)) with one tensor-core kernel (int4_matmul.cu
    "fused kernels"); `epilogue` is rope_f32 | rope_f16 | silu | gelu | argmax, `extra` its arguments.
    Above kernels.FUSED_NORM_TOKENS tokens a tile's blocks would each normalise all its activations
    again per unit: rmsnorm runs first, into acts.xn, and the kernel ("_xn") takes x normalised."""
    assert lin.kind == "int4_tc" and ldx >= lin.Kp, f"{lin.name}: no fused kernel for {lin.kind} / width {ldx}"
    plan = matmul_plan(lin, M, dev.num_sms, acts.mm_mode)
    if plan.tokens > FUSED_NORM_TOKENS:
        launch_rmsnorm(dev, c, x, ldx, norm_w, acts.xn, acts.ld_xn, 0, M, stream)
        x, ldx, norm_w = acts.xn, acts.ld_xn, 0
    args = dict(_FUSED_NONE, x=x, ldx=ldx, M=M, qw=lin.w, sz=lin.aux, num_units=lin.Kp // 128,
                group_size=lin.group_size, units_per_split=plan.units_per_split, bias=lin.bias, y=y, ldy=ldy, N=lin.N,
                accumulate=0, ws=acts.mm_ws, counters=acts.mm_counters, norm_w=norm_w, norm_dim=c.hidden_size,
                eps=c.rms_norm_eps)
    args.update(extra)
    dev.launch(fused_kernel(plan.kernel, plan.tokens, epilogue), plan.grid, 256, stream, **args)


def launch_embed(dev, c: ModelConfig, w: DeviceWeights, acts: Activations, g: StepGeometry, stream) -> None:
    e = w.embed
    dev.launch(f"embed_{e.kind}", (g.num_tokens,), 256, stream, token_ids=g.token_ids, table=e.table,
               scales=e.scales, zeros=e.zeros, ldw=e.ldw, group_size=e.group_size, vocab_size=c.vocab_size,
               D=c.hidden_size, multiplier=c.embedding_multiplier, out=acts.h, ldo=acts.ld_h)


def launch_rmsnorm(dev, c: ModelConfig, x: int, ldx: int, weight: int, out: int, ldo: int, rows: int,
                   num_rows: int, stream, accumulate: bool = False) -> None:
    dev.launch("rmsnorm", (num_rows,), 256, stream, x=x, ldx=ldx, rows=rows, w=weight, out=out, ldo=ldo,
               D=c.hidden_size, eps=c.rms_norm_eps, accumulate=int(accumulate))


def launch_qkv_rope(dev, c: ModelConfig, w: DeviceWeights, layer, i: int, acts: Activations, kv: KVCache,
                    g: StepGeometry, stream) -> None:
    """rmsnorm -> qkv -> RoPE + KV append as one kernel (layer.qkv in the "rope" row order)."""
    suffix = "f32" if kv.dtype == "float32" else "f16"
    local = c.rope_local_theta is not None and c.layer_window(i) is not None     # Gemma 3's sliding layers
    launch_matmul_fused(dev, c, layer.qkv, f"rope_{suffix}", acts.h, acts.ld_h, g.num_tokens, acts.qkv, acts.ld_qkv,
                        layer.attn_norm, acts, stream, positions=g.positions, slot_mapping=g.slot_mapping,
                        cos_sin=w.cos_sin_local if local else w.cos_sin, max_positions=w.max_positions,
                        q_out=acts.q, ldq=acts.ld_q,
                        k_cache=kv.k[i], v_cache=kv.v[i], num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim)


def launch_attention(dev, c: ModelConfig, w: DeviceWeights, i: int, acts: Activations, kv: KVCache,
                     g: StepGeometry, stream, rope: bool = True, fused: bool = False) -> None:
    """[RoPE + KV append,] paged attention [and the split combine, or folded in with `fused`]."""
    hpb = heads_per_block(c)
    group = c.num_heads // c.num_kv_heads
    suffix = "f32" if kv.dtype == "float32" else "f16"
    layer = w.layers[i]
    local = c.rope_local_theta is not None and c.layer_window(i) is not None     # Gemma 3's sliding layers
    if rope:
        if layer.q_norm:            # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
            dev.launch("head_rmsnorm", (g.num_tokens, c.num_heads + c.num_kv_heads), 32, stream, qkv=acts.qkv,
                       ldqkv=acts.ld_qkv, q_norm=layer.q_norm, k_norm=layer.k_norm, num_heads=c.num_heads,
                       head_dim=c.head_dim, eps=c.rms_norm_eps)
        dev.launch(f"rope_kv_append_{suffix}", (g.num_tokens,), 128, stream, qkv=acts.qkv, ldqkv=acts.ld_qkv,
                   positions=g.positions, slot_mapping=g.slot_mapping,
                   cos_sin=w.cos_sin_local if local else w.cos_sin, max_positions=w.max_positions,
                   q_out=acts.q, ldq=acts.ld_q, k_cache=kv.k[i], v_cache=kv.v[i], num_heads=c.num_heads,
                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    extra = {"counters": acts.att_counters} if fused else {}
    dev.launch(f"attention_paged_{'fused_' if fused else ''}{suffix}",
               (g.num_items, c.num_kv_heads * (group // hpb), g.num_splits), 128, stream,
               smem=attention_smem_bytes(c.head_dim), q=acts.q, ldq=acts.ld_q, k_cache=kv.k[i], v_cache=kv.v[i],
               block_tables=g.block_tables, ld_bt=g.ld_bt, positions=g.positions, items=g.items, out=acts.attn,
               ldo=acts.ld_attn, ws_ml=acts.ws_ml, ws_acc=acts.ws_acc, max_splits=g.num_splits,
               num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=kv.block_size,
               heads_per_block=hpb, sliding_window=c.layer_window(i) or 0, scale=float(np.float32(c.softmax_scale)),
               softcap=c.attn_logit_softcap or 0.0, split_size=g.split_size, **extra)
    if g.num_splits > 1 and not fused:
        dev.launch("attention_combine", (g.num_tokens, c.num_heads), 128, stream, ws_ml=acts.ws_ml, ws_acc=acts.ws_acc,
                   num_splits=g.num_splits, max_splits=g.num_splits, out=acts.attn, ldo=acts.ld_attn,
                   num_heads=c.num_heads, head_dim=c.head_dim)


def launch_forward(dev, c: ModelConfig, w: DeviceWeights, acts: Activations, kv: KVCache,
                   g: StepGeometry, stream, fused: bool = False, greedy: bool = False) -> bool:
    """One step of the model (hot path: once per eager step, or once per graph capture).
    -> True when the greedy argmax was folded into lm_head (acts.tokens is then written)."""
    T, a = g.num_tokens, acts
    launch_embed(dev, c, w, a, g, stream)
    glu = "glu_silu" if c.activation == "silu" else "glu_gelu_tanh"
    for i, layer in enumerate(w.layers):
        if fused and layer.qkv.rows == "rope":
            launch_qkv_rope(dev, c, w, layer, i, a, kv, g, stream)
        else:
            launch_rmsnorm(dev, c, a.h, a.ld_h, layer.attn_norm, a.xn, a.ld_xn, 0, T, stream)
            launch_matmul(dev, layer.qkv, a.xn, a.ld_xn, T, a.qkv, a.ld_qkv, False, a, stream)
        launch_attention(dev, c, w, i, a, kv, g, stream, rope=not (fused and layer.qkv.rows == "rope"), fused=fused)
        launch_residual(dev, c, layer.o, a.attn, a.ld_attn, layer.post_attn_norm, a, T, stream)
        if fused and layer.gate_up.rows == "glu":
            launch_matmul_fused(dev, c, layer.gate_up, "silu" if c.activation == "silu" else "gelu", a.h, a.ld_h, T,
                                a.act, a.ld_act, layer.mlp_norm, a, stream)
        else:
            launch_rmsnorm(dev, c, a.h, a.ld_h, layer.mlp_norm, a.xn, a.ld_xn, 0, T, stream)
            launch_matmul(dev, layer.gate_up, a.xn, a.ld_xn, T, a.gu, a.ld_gu, False, a, stream)
            dev.launch(glu, (-(-c.intermediate_size // 256), T), 256, stream, gate_up=a.gu, ldg=a.ld_gu,
                       out=a.act, ldo=a.ld_act, I=c.intermediate_size)
        launch_residual(dev, c, layer.down, a.act, a.ld_act, layer.post_mlp_norm, a, T, stream)
    if not g.num_rows:
        return False
    if fused and greedy and w.lm_head.kind == "int4_tc" and not g.logits_rows and not c.final_logit_softcap:
        launch_matmul_fused(dev, c, w.lm_head, "argmax", a.h, a.ld_h, g.num_rows, a.logits, a.ld_logits, w.norm, a,
                            stream, argmax_keys=a.am_keys, argmax_counters=a.am_counters, tokens=a.tokens)
        return True
    launch_rmsnorm(dev, c, a.h, a.ld_h, w.norm, a.hn, a.ld_hn, g.logits_rows, g.num_rows, stream)
    launch_matmul(dev, w.lm_head, a.hn, a.ld_hn, g.num_rows, a.logits, a.ld_logits, False, a, stream)
    if c.final_logit_softcap:       # Gemma 2, before any sampling
        dev.launch("logit_softcap", (g.num_rows,), 256, stream, logits=a.logits, ldl=a.ld_logits,
                   vocab_size=c.vocab_size, cap=c.final_logit_softcap)
    return False


def launch_residual(dev, c: ModelConfig, lin: Linear, x: int, ldx: int, post_norm: int, a: Activations, T: int,
                    stream) -> None:
    """h += x W^T, or (Gemma 2/3's post norms) h += RMSNorm(x W^T) through xn, free after its product."""
    if not post_norm:
        launch_matmul(dev, lin, x, ldx, T, a.h, a.ld_h, True, a, stream)
        return
    launch_matmul(dev, lin, x, ldx, T, a.xn, a.ld_xn, False, a, stream)
    launch_rmsnorm(dev, c, a.xn, a.ld_xn, post_norm, a.h, a.ld_h, 0, T, stream, accumulate=True)


def launch_step(dev, c: ModelConfig, w: DeviceWeights, acts: Activations, kv: KVCache, g: StepGeometry,
                mode: str, stream, fused: bool = False) -> None:
    """The forward pass and, for the rows that sample, the sampler in `mode` (hot path)."""
    folded = launch_forward(dev, c, w, acts, kv, g, stream, fused=fused, greedy=mode == "greedy")
    if g.num_rows and not folded:
        launch_sampler(dev, c, acts, g, mode, stream)


def launch_sampler(dev, c: ModelConfig, acts: Activations, g: StepGeometry, mode: str, stream) -> None:
    """Sampled ids into acts.tokens (and logprobs) for g.num_rows rows (hot path)."""
    R, a, V = g.num_rows, acts, c.vocab_size
    if mode == "greedy":
        dev.launch("argmax_rows", (R,), 1024, stream, logits=a.logits, ldl=a.ld_logits, vocab_size=V, tokens=a.tokens)
        return
    dev.launch("apply_penalties", (R,), 256, stream, logits=a.logits, plogits=a.plogits, ldl=a.ld_logits,
               vocab_size=V, fparams=g.fparams, iparams=g.iparams, row_ptr=g.pen_row_ptr, entries=g.pen_entries)
    dev.launch("sample_tokens", (R,), 1024, stream, smem=sample_smem_bytes(), logits=a.logits, plogits=a.plogits,
               ldl=a.ld_logits, vocab_size=V, dparams=g.dparams, iparams=g.iparams, rng=g.rng, tokens=a.tokens)
    dev.launch("compute_logprobs", (R,), 1024, stream, logits=a.logits, ldl=a.ld_logits, vocab_size=V,
               iparams=g.iparams, tokens=a.tokens, token_logprob=a.token_logprob, top_ids=a.top_ids,
               top_logprobs=a.top_logprobs)
