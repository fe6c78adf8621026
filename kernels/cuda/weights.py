"""Engine tensors -> device memory, once, in the layouts the kernels read.

Contract:
- `upload_weights(rt, config, tensors, matmul)` copies every weight of an engine
  (docs/ENGINE_FORMAT.md encodings) into one device arena and returns `DeviceWeights`:
  typed records (`Linear`, `EmbedTable`, `LayerWeights`) holding device pointers and the
  dimensions each kernel launch needs. Nothing is allocated on the device after this.
- INT4 matrices go to the tensor-core "tc" layout (matmul="tc": the int4_repack_tc kernel
  rewrites the engine packing on the device) or stay in the engine packing for the SIMT
  kernel (matmul="simt", and any matrix whose zero points are not integers 0..15). Dense and
  int8 matrices keep row-major rows padded to 8 columns.
- The RoPE cos/sin table is built here too (kernels/rope.py: float64 angles, rounded once).
- `fused=True`: the qkv and gate_up matrices that take the tensor-core kernels are stored in the
  row orders of the fused kernels' epilogues (layout.rope_row_order, glu_row_order; their
  `rows` says which), where the shapes allow; the others stay in logical order ("plain") and
  take the unfused kernels.
`dev` is the `Device` (kernels/cuda/device.py): driver, streams and kernels.
"""

from typing import Mapping, NamedTuple, Optional

import numpy as np

from ...core.config import ModelConfig
from ..engine_format import linear_shapes, vector_shapes
from ..rope import rope_cos_sin, rope_inv_freq
from .layout import glu_row_order, round_up, rope_row_order, tc_shape

ALIGN = 256


class Linear(NamedTuple):
    """One projection y = x W^T on the device."""
    name: str
    kind: str                   # "int4_tc" | "int4_simt" | "dense_f32" | "dense_f16" | "dense_i8"
    N: int                      # output features
    K: int                      # input features (x must have >= Kp columns, zero past K)
    Kp: int                     # padded K the kernel reads
    w: int                      # tc: qw | simt: qweight | dense: rows
    aux: int                    # tc: sz | simt: scales | dense_i8: row scales | else 0
    zeros: int                  # simt: zeros | else 0
    group_size: int             # int4 only
    bias: int = 0               # fp32 [N] or 0 (in the rows' order)
    rows: str = "plain"         # device row order: "plain", "rope" or "glu" (layout.py, fused kernels)


class EmbedTable(NamedTuple):
    kind: str                   # "f32" | "f16" | "i8" | "i4"
    table: int
    scales: int
    zeros: int
    ldw: int                    # elements per row (bytes per row for i4)
    group_size: int


class LayerWeights(NamedTuple):
    attn_norm: int              # fp32 [D]
    qkv: Linear
    o: Linear
    mlp_norm: int               # fp32 [D]
    gate_up: Linear
    down: Linear
    q_norm: int = 0             # fp32 [hd] each, 0 without qk_norm (Qwen3, Gemma 3)
    k_norm: int = 0
    post_attn_norm: int = 0     # fp32 [D], 0 without post_norms (Gemma 2/3)
    post_mlp_norm: int = 0


class DeviceWeights(NamedTuple):
    embed: EmbedTable
    layers: tuple
    norm: int                   # fp32 [D]
    lm_head: Linear
    cos_sin: int                # float2 [max_positions, hd/2]
    max_positions: int
    num_bytes: int              # device bytes of the arena
    arena: int                  # the one allocation (freed by the executor)
    cos_sin_local: int = 0      # float2 [max_positions, hd/2] of Gemma 3's sliding layers, or 0


class _Arena:
    """Bump allocation inside one device buffer: plan sizes first, then allocate once."""

    def __init__(self):
        self.size = 0

    def take(self, nbytes: int) -> int:
        offset = self.size
        self.size += round_up(max(int(nbytes), 1), ALIGN)
        return offset


def upload_weights(dev, config: ModelConfig, tensors: Mapping[str, np.ndarray], matmul: str,
                   max_positions: int, fused: bool = False) -> DeviceWeights:
    return _Loader(dev, config, tensors, matmul, fused).run(max_positions)


class _Loader:
    def __init__(self, dev, config, tensors, matmul, fused=False):
        if matmul not in ("tc", "simt"):
            raise ValueError(f"matmul must be 'tc' or 'simt', got {matmul!r}")
        self.dev, self.config, self.tensors, self.matmul, self.fused = dev, config, tensors, matmul, fused
        self.mats, self.vecs = linear_shapes(config), vector_shapes(config)
        self.arena = _Arena()
        self.copies = []             # (offset, host array): run after the one allocation
        self.repacks = []            # (staging offsets, tc offsets, shape)
        self.staging_bytes = 0

    def run(self, max_positions: int) -> DeviceWeights:
        c = self.config
        embed = self.plan_embed()
        layers = [self.plan_layer(i) for i in range(c.num_layers)]
        norm = self.plan_vector("norm")
        lm_head = self.plan_lm_head(embed)
        cos, sin = rope_cos_sin(rope_inv_freq(c), np.arange(max_positions))
        cos_sin = self.plan_copy(np.ascontiguousarray(np.stack([cos, sin], axis=-1)))   # [P, hd/2, 2]
        cos_sin_local = None
        if c.rope_local_theta is not None:
            cos, sin = rope_cos_sin(rope_inv_freq(c, c.rope_local_theta), np.arange(max_positions))
            cos_sin_local = self.plan_copy(np.ascontiguousarray(np.stack([cos, sin], axis=-1)))
        base = self.dev.drv.mem_alloc(self.arena.size)
        self.upload(base)
        fix = lambda off: base + off if off is not None else 0   # noqa: E731
        return DeviceWeights(
            embed=embed._replace(table=fix(embed.table), scales=fix(embed.scales), zeros=fix(embed.zeros)),
            layers=tuple(LayerWeights(fix(l.attn_norm), _fix_linear(l.qkv, fix), _fix_linear(l.o, fix),
                                      fix(l.mlp_norm), _fix_linear(l.gate_up, fix), _fix_linear(l.down, fix),
                                      fix(l.q_norm), fix(l.k_norm), fix(l.post_attn_norm), fix(l.post_mlp_norm))
                         for l in layers),
            norm=fix(norm), lm_head=_fix_linear(lm_head, fix), cos_sin=fix(cos_sin),
            max_positions=max_positions, num_bytes=self.arena.size, arena=base, cos_sin_local=fix(cos_sin_local))

    # ------------------------------------------------------------ planning (offsets only)

    def plan_copy(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        offset = self.arena.take(array.nbytes)
        self.copies.append((offset, array))
        return offset

    def plan_vector(self, name: str, order: Optional[np.ndarray] = None) -> int:
        v = np.asarray(self.tensors[name] if name in self.tensors else _missing(name), dtype=np.float32)
        if v.shape != tuple(self.vecs[name]):
            raise ValueError(f"engine tensor {name!r} has shape {list(v.shape)}, the config needs {list(self.vecs[name])}")
        return self.plan_copy(v if order is None else v[order])

    def plan_layer(self, i: int) -> LayerWeights:
        p, c = f"layers.{i}", self.config
        rope = gate = None
        if self.fused and c.head_dim % 16 == 0 and not c.qk_norm:      # q/k norms run between qkv and RoPE
            rope = ("rope", rope_row_order(c.num_heads + 2 * c.num_kv_heads, c.head_dim))
        if self.fused and c.intermediate_size % 8 == 0:
            gate = ("glu", glu_row_order(c.intermediate_size))
        qkv = self.plan_linear(f"{p}.qkv_proj", rope)
        if c.qkv_bias:
            qkv = qkv._replace(bias=self.plan_vector(f"{p}.qkv_bias", rope[1] if qkv.rows == "rope" else None))
        qk = (self.plan_vector(f"{p}.q_norm"), self.plan_vector(f"{p}.k_norm")) if c.qk_norm else (None, None)
        post = ((self.plan_vector(f"{p}.post_attn_norm"), self.plan_vector(f"{p}.post_mlp_norm")) if c.post_norms
                else (None, None))
        return LayerWeights(self.plan_vector(f"{p}.attn_norm"), qkv, self.plan_linear(f"{p}.o_proj"),
                            self.plan_vector(f"{p}.mlp_norm"), self.plan_linear(f"{p}.gate_up_proj", gate),
                            self.plan_linear(f"{p}.down_proj"), *qk, *post)

    def plan_linear(self, name: str, order: Optional[tuple] = None) -> Linear:
        """`order`: (label, device row -> logical row) for a tensor-core matrix of a fused kernel."""
        N, K = self.mats[name]
        t = self.tensors
        if f"{name}.zeros" in t:
            return self.plan_int4(name, N, K, order)
        if f"{name}.qweight" in t:
            q = _matrix(t, f"{name}.qweight", N, K, np.int8)
            scales = np.asarray(t[f"{name}.scales"], dtype=np.float16).reshape(N)
            return Linear(name, "dense_i8", N, K, round_up(K, 8), self.plan_copy(_pad_cols(q, 8)),
                          self.plan_copy(scales), None, 0, None)
        if f"{name}.weight" in t:
            w = np.asarray(t[f"{name}.weight"])
            kind = {np.dtype(np.float32): "dense_f32", np.dtype(np.float16): "dense_f16"}.get(w.dtype)
            if kind is None:
                raise ValueError(f"engine tensor {name}.weight has dtype {w.dtype}; expected float16 or float32")
            w = _matrix(t, f"{name}.weight", N, K, w.dtype)
            return Linear(name, kind, N, K, round_up(K, 8), self.plan_copy(_pad_cols(w, 8)), None, None, 0, None)
        return _missing(f"{name}.weight or {name}.qweight")

    def plan_lm_head(self, embed: EmbedTable) -> Linear:
        """The classifier; a tied dense or int8 embedding serves as it in place (one copy)."""
        c = self.config
        if not c.tie_word_embeddings:
            return self.plan_linear("lm_head")
        kind = {"f32": "dense_f32", "f16": "dense_f16", "i8": "dense_i8"}.get(embed.kind)
        if kind is None or c.hidden_size % 8:
            return self.plan_linear("embed")                 # int4: the tensor-core layout is another copy
        return Linear("embed", kind, c.vocab_size, c.hidden_size, c.hidden_size, embed.table, embed.scales,
                      None, 0, None)

    def plan_int4(self, name: str, N: int, K: int, order: Optional[tuple] = None) -> Linear:
        t = self.tensors
        qweight = np.asarray(t[f"{name}.qweight"], dtype=np.uint8)
        scales = np.asarray(t[f"{name}.scales"], dtype=np.float16)
        zeros = np.asarray(t[f"{name}.zeros"], dtype=np.float16)
        if qweight.shape[0] != N or qweight.shape[1] * 2 < K or scales.shape != zeros.shape or scales.shape[0] != N:
            raise ValueError(f"engine tensor {name!r}: int4 parts {qweight.shape}/{scales.shape}/{zeros.shape} "
                             f"do not match the logical shape [{N}, {K}]")
        group_size = qweight.shape[1] * 2 // scales.shape[1]
        if self.matmul == "simt" or not integer_zeros(zeros):
            return Linear(name, "int4_simt", N, K, qweight.shape[1] * 2, self.plan_copy(qweight),
                          self.plan_copy(scales), self.plan_copy(zeros), group_size, None)
        rows = "plain"
        if order is not None:
            rows, index = order
            qweight, scales, zeros = qweight[index], scales[index], zeros[index]
        shape = tc_shape(N, K, group_size)
        qw = self.arena.take(shape.qw_words * 4)
        sz = self.arena.take(shape.sz_words * 4)
        self.repacks.append(((qweight, scales, zeros), (qw, sz), shape))
        self.staging_bytes = max(self.staging_bytes, sum(round_up(a.nbytes, ALIGN) for a in (qweight, scales, zeros)))
        return Linear(name, "int4_tc", N, K, shape.Kp, qw, sz, None, group_size, None, rows)

    def plan_embed(self) -> EmbedTable:
        t, (V, D) = self.tensors, self.mats["embed"]
        if "embed.zeros" in t:
            q = np.asarray(t["embed.qweight"], dtype=np.uint8)
            group_size = q.shape[1] * 2 // t["embed.scales"].shape[1]
            return EmbedTable("i4", self.plan_copy(q), self.plan_copy(np.asarray(t["embed.scales"], np.float16)),
                              self.plan_copy(np.asarray(t["embed.zeros"], np.float16)), q.shape[1], group_size)
        if "embed.qweight" in t:
            q = _matrix(t, "embed.qweight", V, D, np.int8)
            return EmbedTable("i8", self.plan_copy(q), self.plan_copy(np.asarray(t["embed.scales"], np.float16)),
                              None, D, 0)
        w = np.asarray(t["embed.weight"]) if "embed.weight" in t else _missing("embed.weight")
        kind = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(w.dtype)
        if kind is None:
            raise ValueError(f"engine tensor embed.weight has dtype {w.dtype}; expected float16 or float32")
        return EmbedTable(kind, self.plan_copy(_matrix(t, "embed.weight", V, D, w.dtype)), None, None, D, 0)

    # ------------------------------------------------------------ the copies

    def upload(self, base: int) -> None:
        drv, stream = self.dev.drv, self.dev.copy_stream
        for offset, array in self.copies:
            drv.memcpy_htod_async(base + offset, array, array.nbytes, stream)
        if self.repacks:
            staging = drv.mem_alloc(self.staging_bytes)      # load-time scratch, freed below
            try:
                for parts, (qw, sz), shape in self.repacks:
                    self.repack(staging, parts, base + qw, base + sz, shape)
                    drv.stream_synchronize(stream)           # the staging buffer is reused next
            finally:
                drv.mem_free(staging)
        drv.stream_synchronize(stream)

    def repack(self, staging: int, parts, qw: int, sz: int, shape) -> None:
        drv, stream = self.dev.drv, self.dev.copy_stream
        qweight, scales, zeros = parts
        ptrs, offset = [], 0
        for a in parts:
            drv.memcpy_htod_async(staging + offset, a, a.nbytes, stream)
            ptrs.append(staging + offset)
            offset += round_up(a.nbytes, ALIGN)
        total = shape.qw_words + shape.sz_words
        self.dev.launch("int4_repack_tc", (-(-total // 256), 1, 1), 256, stream,
                        qweight=ptrs[0], scales=ptrs[1], zeros=ptrs[2], N=shape.N, Kb=qweight.shape[1],
                        num_src_groups=scales.shape[1], qw=qw, sz=sz, num_tiles=shape.num_tiles,
                        num_chunks=shape.num_chunks, num_groups=shape.num_groups)


def integer_zeros(zeros: np.ndarray) -> bool:
    """The tensor-core kernels fold zero points into the 4-bit codes exactly: integers 0..15 only
    (tokenwire's quantizer always writes such; other zero points take the SIMT kernel)."""
    z = np.asarray(zeros, dtype=np.float32)
    return bool(np.all(z == np.round(z)) and z.min(initial=0) >= 0 and z.max(initial=0) <= 15)


def _fix_linear(lin: Linear, fix) -> Linear:
    """Arena offsets -> device pointers (None, "absent" while planning, becomes a null pointer)."""
    return lin._replace(w=fix(lin.w), aux=fix(lin.aux), zeros=fix(lin.zeros), bias=fix(lin.bias))


def _matrix(tensors, key: str, N: int, K: int, dtype) -> np.ndarray:
    a = np.asarray(tensors[key])
    if a.shape != (N, K):
        raise ValueError(f"engine tensor {key!r} has shape {list(a.shape)}, the config needs [{N}, {K}]")
    return a.astype(dtype, copy=False)


def _pad_cols(a: np.ndarray, multiple: int) -> np.ndarray:
    pad = round_up(a.shape[1], multiple) - a.shape[1]
    return a if pad == 0 else np.pad(a, ((0, 0), (0, pad)))


def _missing(what: str):
    raise KeyError(f"engine tensor {what} is missing")


def linear_bytes(lin: Optional[Linear]) -> int:
    """Device bytes one decode step reads for this weight (the roofline's numerator)."""
    if lin is None:
        return 0
    if lin.kind.startswith("int4"):
        shape = tc_shape(lin.N, lin.K, lin.group_size)
        return lin.N * shape.Kp // 2 + lin.N * shape.num_groups * 4
    return lin.N * round_up(lin.K, 8) * {"dense_f32": 4, "dense_f16": 2, "dense_i8": 1}[lin.kind]
