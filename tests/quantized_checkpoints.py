"""Tiny 4-bit Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors), written from each
format's published layout: a float model saved by transformers, then every decoder linear
layer quantized round-to-nearest here and packed the way AutoAWQ (GEMM), AutoGPTQ (including
act-order `g_idx` and the zero - 1 offset of the original format) and compressed-tensors
(pack-quantized) store it. `quantize_checkpoint(dir, method, group_size, ...)` rewrites the
directory in place and returns {module prefix: float32 [N, K]}, the format's dequantization.
"""

import json

import numpy as np
from safetensors.numpy import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def pack_nibbles(values: np.ndarray, axis: int) -> np.ndarray:
    """uint [.., 8m, ..] (0..15) -> int32 [.., m, ..]: value 8j + i in bits 4i.. of int32 j."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(8):
        packed |= v[..., i] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(packed.view(np.int32), -1, axis))


def rtn_groups(w: np.ndarray, g_idx: np.ndarray, groups: int, symmetric: bool) -> tuple:
    """w [N, K], columns grouped by g_idx -> (q uint8 [N, K], scales fp16 [N, groups], zeros int [N, groups])."""
    n, k = w.shape
    scales, zeros = np.zeros((n, groups), np.float16), np.zeros((n, groups), np.int64)
    q = np.zeros((n, k), np.uint8)
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        block = w[:, cols]
        if symmetric:
            s, z = np.abs(block).max(1) / 7, np.full(n, 8)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            s = (hi - lo) / 15
        s16 = np.maximum(s, 1e-4).astype(np.float16)
        if not symmetric:
            z = np.clip(np.round(-lo / s16.astype(np.float32)), 0, 15).astype(np.int64)
        scales[:, g], zeros[:, g] = s16, z
        q[:, cols] = np.clip(np.round(block / s16.astype(np.float32)[:, None]) + z[:, None], 0, 15)
    return q, scales, zeros


def dequantize(q, scales, zeros, g_idx) -> np.ndarray:
    return (q.astype(np.float32) - zeros[:, g_idx].astype(np.float32)) * scales[:, g_idx].astype(np.float32)


def awq_tensors(q, scales, zeros) -> dict:
    """[N, K] codes -> AutoAWQ GEMM: qweight [K, N/8], qzeros [K/G, N/8] (interleaved), scales [K/G, N]."""
    def pack_n(a):                                    # a [R, N] -> [R, N/8], nibble i = column AWQ_ORDER[i]
        r, n = a.shape
        return pack_nibbles(a.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)].reshape(r, n), axis=1)
    return {"qweight": pack_n(q.T), "qzeros": pack_n(zeros.T.astype(np.uint8)), "scales": scales.T.copy()}


def gptq_tensors(q, scales, zeros, g_idx, v1: bool) -> dict:
    """-> qweight [K/8, N] (packed along K), qzeros [K/G, N/8] (zero - 1 in the original format), scales, g_idx."""
    stored = (zeros - 1) & 0xF if v1 else zeros
    return {"qweight": pack_nibbles(q.T, axis=0), "qzeros": pack_nibbles(stored.T.astype(np.uint8), axis=1),
            "scales": scales.T.copy(), "g_idx": g_idx.astype(np.int32)}


def compressed_tensors_tensors(q, scales, zeros, g_idx, symmetric: bool, actorder: bool) -> dict:
    """pack-quantized: weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G] (asym)."""
    n, k = q.shape
    out = {"weight_packed": pack_nibbles(q, axis=1), "weight_scale": scales.copy(),
           "weight_shape": np.array([n, k], dtype=np.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_nibbles(zeros.astype(np.uint8), axis=0)
    if actorder:
        out["weight_g_idx"] = g_idx.astype(np.int32)
    return out


def quant_config(method: str, group_size: int, symmetric: bool, act_order: bool, v1: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


def quantize_checkpoint(root, method: str, group_size: int, symmetric=False, act_order=False, v1=True,
                        seed=0) -> dict:
    rng = np.random.default_rng(seed)
    tensors = load_file(str(root / "model.safetensors"))
    config = json.loads((root / "config.json").read_text())
    expected = {}
    for i in range(config["num_hidden_layers"]):
        for module in MODULES:
            prefix = f"model.layers.{i}.{module}"
            w = tensors.pop(prefix + ".weight").astype(np.float32)
            k = w.shape[1]
            groups = k // group_size
            g_idx = np.arange(k) // group_size
            if act_order:
                g_idx = np.empty(k, dtype=np.int64)
                g_idx[rng.permutation(k)] = np.arange(k) // group_size
            q, scales, zeros = rtn_groups(w, g_idx, groups, symmetric)
            # the original GPTQ format cannot hold a zero of 0: its nibble reads back as 15 + 1
            effective = ((zeros - 1) & 0xF) + 1 if method == "gptq" and v1 else zeros
            expected[prefix] = dequantize(q, scales, effective, g_idx)
            if method == "awq":
                parts = awq_tensors(q, scales, zeros)
            elif method == "gptq":
                parts = gptq_tensors(q, scales, zeros, g_idx, v1)
            else:
                parts = compressed_tensors_tensors(q, scales, zeros, g_idx, symmetric, act_order)
            tensors.update({f"{prefix}.{name}": a for name, a in parts.items()})
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quant_config(method, group_size, symmetric, act_order, v1)
    (root / "config.json").write_text(json.dumps(config))
    return expected
