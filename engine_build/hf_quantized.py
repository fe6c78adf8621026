"""4-bit Hugging Face checkpoints (config.json `quantization_config`): AWQ, GPTQ and
compressed-tensors pack-quantized W4A16, unpacked into imported.py's `Int4Codes` without
rounding anything again.

Layouts (W is nn.Linear's [N, K]; G the group size; every int32 holds eight 4-bit values,
value i in bits 4i..4i+3):
- AWQ, AutoAWQ "gemm" (`quant_method: awq`, `version: gemm`): `qweight` int32 [K, N/8] and
  `qzeros` int32 [K/G, N/8], packed along N in the interleaved order (0, 2, 4, 6, 1, 3, 5, 7):
  nibble i holds column 8j + AWQ_ORDER[i]; `scales` fp16 [K/G, N].
  W[n, k] = (q - z[k // G, n]) * s[k // G, n].
- GPTQ (`quant_method: gptq`): `qweight` int32 [K/8, N] packed along K (nibble i of row r is
  k = 8r + i); `qzeros` int32 [K/G, N/8] packed along N in order; `scales` fp16 [K/G, N];
  `g_idx` int32 [K], the group of each input column. The original format
  (`checkpoint_format: gptq`, AutoGPTQ) stores zero - 1, so the zero is the nibble + 1
  (1..16, which float16 zeros hold exactly); `gptq_v2` stores the zero itself.
  W[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n].
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K/8] packed along K in
  order, values stored as q + 8 (signed -8..7); `weight_scale` [N, K/G] (fp16 or bf16);
  asymmetric: `weight_zero_point` int32 [ceil(N/8), K/G] packed along N, also + 8;
  `weight_g_idx` [K] with activation ordering. W = (q_stored - z_stored) * s, so the engine's
  zero is the stored zero (8 when symmetric).

Act-order (a g_idx that is not k // G) puts each group's columns anywhere along K, while the
engine's groups are contiguous. For down_proj that is undone exactly: its columns are sorted
by group (`input_order`) and the gate and up rows, which produce those inputs, are permuted the
same way, so the model computes the same function with every group contiguous. The other
projections read the residual stream or the attention heads, whose order is fixed: they are
dequantized exactly and rounded again (origin "requantized", with the error in the report). Group sizes other than 32, 64 and 128
(and per-channel scales) are refused: the engine's kernels have no other group size.
Modules a checkpoint leaves unquantized (`lm_head`, `modules_to_not_convert`, `ignore`) are
read as float.
"""

from pathlib import Path

import numpy as np

from ..core.errors import BuildError
from .imported import Int4Codes, codes_by_rtn, codes_from_float16

GROUP_SIZES = (32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of 8
METHODS = ("awq", "gptq", "compressed-tensors")


def unpack_int32(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 [..] -> uint8 nibbles, 8 per int32 along `axis`, value i from bits 4i.."""
    u = packed.astype(np.int64) & 0xFFFFFFFF
    nibbles = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=axis + 1)    # [.., 8, ..]
    shape = list(packed.shape)
    shape[axis] *= 8
    return nibbles.reshape(shape).astype(np.uint8)


class QuantizedCheckpoint:
    """Reads the 4-bit linear layers of one checkpoint (`weights`: hf.WeightFiles)."""

    def __init__(self, quant: dict, weights, origin: Path):
        self.weights, self.origin = weights, origin
        self.method = quant.get("quant_method")
        if self.method not in METHODS:
            raise BuildError(origin, f"quantization_config.quant_method {self.method!r} is not supported "
                                     f"(supported: {', '.join(METHODS)})")
        args = _compressed_tensors_args(quant, origin) if self.method == "compressed-tensors" else quant
        bits = args.get("bits", args.get("num_bits"))
        if bits != 4:
            raise BuildError(origin, f"{self.method} checkpoints with {bits}-bit weights are not supported (only 4-bit)")
        self.group_size = args.get("group_size")
        if self.group_size not in GROUP_SIZES:
            raise BuildError(origin, f"{self.method} group size {self.group_size} is not supported: tokenwire's INT4 "
                                     f"kernels use groups of {', '.join(map(str, GROUP_SIZES))} along K")
        if self.method == "awq" and (str(quant.get("version", "gemm")).lower() != "gemm" or not quant.get("zero_point", True)):
            raise BuildError(origin, f"AWQ version {quant.get('version')!r} with zero_point={quant.get('zero_point')} "
                                     "is not supported (only AutoAWQ's GEMM packing with zero points)")
        self.v1_zeros = self.method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq"
        self.description = f"{self.method} g{self.group_size}" + (" (act-order)" if args.get("desc_act")
                                                                   or args.get("actorder") else "")

    def is_quantized(self, prefix: str) -> bool:
        return (prefix + (".weight_packed" if self.method == "compressed-tensors" else ".qweight")) in self.weights

    def read_float(self, prefix: str, shape: tuple, order=None) -> np.ndarray:
        """float32 [N, K]: the source's dequantization (or the float weight of an unquantized module),
        columns taken in `order` when given."""
        if not self.is_quantized(prefix):
            w = self.weights.read(prefix + ".weight", shape)
        else:
            q, scales, zeros, g_idx = self._unpacked(prefix, shape)
            w = (q.astype(np.float32) - zeros[:, g_idx].astype(np.float32)) * scales[:, g_idx].astype(np.float32)
        return w if order is None else w[:, order]

    def read_codes(self, prefix: str, shape: tuple, order=None) -> Int4Codes:
        """The module's codes in the engine's grouping (columns in `order`, from input_order, when
        given); act-order modules without one are rounded again (see above)."""
        q, scales, zeros, g_idx = self._unpacked(prefix, shape)
        contiguous = np.arange(shape[1]) // self.group_size
        if order is not None and np.array_equal(g_idx[order], contiguous):
            return codes_from_float16(q[:, order], scales, zeros)
        if not np.array_equal(g_idx, contiguous):
            return codes_by_rtn(self.read_float(prefix, shape, order), self.group_size)
        return codes_from_float16(q, scales, zeros)

    def input_order(self, prefix: str, shape: tuple):
        """Act-order: the column order that makes every group contiguous (stable sort by group),
        when each group has exactly G columns; None when the groups already are, or cannot be."""
        if not self.is_quantized(prefix):
            return None
        k, groups = shape[1], shape[1] // self.group_size
        name = prefix + (".g_idx" if self.method == "gptq" else ".weight_g_idx")
        if self.method == "awq" or name not in self.weights:
            return None
        g_idx = self._g_idx(name, k, groups)
        if np.array_equal(g_idx, np.arange(k) // self.group_size):
            return None
        if not np.all(np.bincount(g_idx, minlength=groups) == self.group_size):
            return None
        return np.argsort(g_idx, kind="stable")

    def _unpacked(self, prefix: str, shape: tuple) -> tuple:
        """-> (q uint8 [N, K], scales [N, K/G] (source dtype), zeros float32 [N, K/G], g_idx int [K])."""
        n, k = shape
        if k % self.group_size or n % 8:
            raise BuildError(self.origin, f"{prefix}: shape {list(shape)} does not divide into groups of "
                                          f"{self.group_size} along K and packs of 8 along N")
        unpack = {"awq": self._awq, "gptq": self._gptq, "compressed-tensors": self._compressed_tensors}[self.method]
        return unpack(prefix, n, k, k // self.group_size)

    def _raw(self, name: str, shape: tuple) -> np.ndarray:
        return self.weights.read_raw(name, shape)

    def _awq(self, prefix: str, n: int, k: int, groups: int) -> tuple:
        order = np.argsort(AWQ_ORDER)            # column c of 8 sits in nibble order[c]
        q = unpack_int32(self._raw(prefix + ".qweight", (k, n // 8)), axis=1).reshape(k, n // 8, 8)[..., order]
        z = unpack_int32(self._raw(prefix + ".qzeros", (groups, n // 8)), axis=1).reshape(groups, n // 8, 8)[..., order]
        scales = self.weights.read(prefix + ".scales", (groups, n))
        return (q.reshape(k, n).T, np.ascontiguousarray(scales.T), z.reshape(groups, n).T.astype(np.float32),
                np.arange(k) // self.group_size)

    def _gptq(self, prefix: str, n: int, k: int, groups: int) -> tuple:
        q = unpack_int32(self._raw(prefix + ".qweight", (k // 8, n)), axis=0)            # [K, N]
        z = unpack_int32(self._raw(prefix + ".qzeros", (groups, n // 8)), axis=1).astype(np.float32)
        z = z + 1 if self.v1_zeros else z
        scales = self.weights.read(prefix + ".scales", (groups, n))
        g_idx = self._g_idx(prefix + ".g_idx", k, groups)
        return q.T, np.ascontiguousarray(scales.T), z.T, g_idx

    def _compressed_tensors(self, prefix: str, n: int, k: int, groups: int) -> tuple:
        stored = tuple(int(d) for d in self._raw(prefix + ".weight_shape", (2,)))
        if stored != (n, k):
            raise BuildError(self.origin, f"{prefix}.weight_shape is {list(stored)}, config.json implies {[n, k]}")
        q = unpack_int32(self._raw(prefix + ".weight_packed", (n, k // 8)), axis=1)
        scales = self.weights.read(prefix + ".weight_scale", (n, groups))
        if prefix + ".weight_zero_point" in self.weights:
            z = unpack_int32(self._raw(prefix + ".weight_zero_point", (-(-n // 8), groups)), axis=0)[:n]
            z = z.astype(np.float32)
        else:
            z = np.full((n, groups), 8, dtype=np.float32)
        g_idx = self._g_idx(prefix + ".weight_g_idx", k, groups)
        return q, scales, z, g_idx

    def _g_idx(self, name: str, k: int, groups: int) -> np.ndarray:
        if name not in self.weights:
            return np.arange(k) // self.group_size
        g_idx = np.asarray(self._raw(name, (k,)), dtype=np.int64)
        if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= groups:
            raise BuildError(self.origin, f"{name} names groups outside 0..{groups - 1}")
        return g_idx


def _compressed_tensors_args(quant: dict, origin) -> dict:
    """The one weight scheme of a compressed-tensors config (config_groups.*.weights)."""
    if quant.get("format") != "pack-quantized":
        raise BuildError(origin, f"compressed-tensors format {quant.get('format')!r} is not supported "
                                 "(only pack-quantized W4A16)")
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0].get("weights"), dict):
        raise BuildError(origin, "compressed-tensors: expected exactly one config group with a weights scheme")
    if groups[0].get("input_activations"):
        raise BuildError(origin, "compressed-tensors: quantized activations are not supported (only W4A16)")
    weights = groups[0]["weights"]
    if weights.get("type", "int") != "int" or weights.get("strategy") != "group":
        raise BuildError(origin, f"compressed-tensors weights of type {weights.get('type')!r} with strategy "
                                 f"{weights.get('strategy')!r} are not supported (only int with group strategy)")
    return weights
