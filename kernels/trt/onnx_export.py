"""ONNX export of an engine's decode and prefill steps: the graph a TensorRT engine is built from.

Contract:
- `export_onnx(config, tensors, out_dir, options)` writes `decode.onnx` (one new token per
  sequence), `prefill.onnx` (any number), `weights.bin` (the weights both graphs point at)
  and `export.json` (what was exported, and the sha256 of each file: kernels/trt/ keys its
  engine cache on it). The math is the numpy reference forward's (kernels/model.py), step for
  step, for every family it supports: GQA, qkv bias, sliding windows (per layer), Llama 3 RoPE
  scaling and GGUF frequency factors, per-layer RoPE bases, per-head q/k norms, post-attention
  and post-MLP norms, the softmax scale, attention and final logit soft-capping, GeGLU, the
  embedding multiplier, tied embeddings.
- Opset 24. Every INT4 matrix is a `DequantizeLinear` (block quantization along K, block
  size = the engine's group size, the weight stored [K, N] so the product is `MatMul(x, W)`)
  feeding a `MatMul`: the weight-only form TensorRT 10+ fuses into its INT4 GEMMs. TensorRT
  accepts only a zero zero-point, so by default (`zero_points="offset"`) the weight is
  signed int4 `q - 8` with no zero point, and an asymmetric engine's `(8 - z) * s` per group
  becomes a second, tiny product on the group sums of x:
  `x @ W = x @ DQ(q - 8, s) + (x @ ones_per_group) @ ((8 - z) * s)`, exact in real arithmetic.
  `zero_points="onnx"` writes ONNX's own form instead (uint4 and a uint4 zero point), which
  onnxruntime runs and TensorRT refuses.
- Inputs: `input_ids`, `positions` int64 [batch, seq]; `seq_lens` int64 [batch] (tokens in the
  cache once this step is written); `past_key.{i}`, `past_value.{i}` float32
  [batch, Hkv, max_len, hd]. Outputs: `logits` float32 [batch, vocab] and `next_token` int32
  [batch] (greedy) for each sequence's last token (`seq_lens - 1`), and `present_key.{i}`,
  `present_value.{i}`. The new K/V go in with `TensorScatter` at `positions[:, 0]` (TensorRT's
  in-place KV cache update: present and past share one buffer), so a sequence's new tokens
  are consecutive positions. Key j is visible to a query at position p when j <= p,
  j < seq_len (and j > p - sliding_window). Padding tokens in a prefill batch need
  distinct positions below max_len; their logits are never read.
"""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ...core.config import ModelConfig
from ..engine_format import linear_shapes
from ..model import decode_weight
from ..reference import unpack_int4
from ..rope import rope_cos_sin, rope_inv_freq
from .onnx_graph import GraphBuilder, WeightsFile, load_onnx, nibble_proto, tensor_proto

OPSET = 24                   # TensorScatter (24); blocked int4 DequantizeLinear (21)
EXPORT_FORMAT = "tokenwire-onnx"
EXPORT_VERSION = 1
DEFAULT_MAX_LEN = 4096
MASKED = np.float32(np.finfo(np.float32).min)   # finite: a fully masked padding row stays NaN-free
ZERO_POINT_MODES = ("offset", "onnx")
MATMUL_DTYPES = {"float32": (np.float32, "FLOAT"), "float16": (np.float16, "FLOAT16")}  # numpy, TensorProto name


@dataclass(frozen=True)
class OnnxExportOptions:
    max_len: Optional[int] = None      # KV cache capacity and RoPE table: default min(max positions, 4096)
    zero_points: str = "offset"        # "offset": TensorRT's form; "onnx": uint4 with a zero point input
    matmul_dtype: str = "float32"      # the weight products' inputs: float32 (the reference's) or float16
                                       # (TensorRT's INT4 GEMMs are W4A16); everything else stays float32

    def __post_init__(self):
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {sorted(MATMUL_DTYPES)}, got {self.matmul_dtype!r}")
        if self.zero_points not in ZERO_POINT_MODES:
            raise ValueError(f"zero_points must be one of {ZERO_POINT_MODES}, got {self.zero_points!r}")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")


class ModelGraph:
    """Builds one step graph (decode or prefill) over the engine's tensors."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], options: OnnxExportOptions,
                 max_len: int):
        self.c, self.t, self.o, self.max_len = config, tensors, options, max_len
        self.g = GraphBuilder()
        self.wtype, wname = MATMUL_DTYPES[options.matmul_dtype]        # weights' float type
        self.wproto, self.float = getattr(self.g.types, wname), self.g.types.FLOAT

    # ------------------------------------------------------------ weights

    def linear(self, x: str, name: str) -> str:
        """x: float32 [..., K] -> float32 [..., N] = x @ W.T for the engine matrix `name` in its stored
        encoding; the product's inputs in matmul_dtype."""
        g = self.g
        if self.wtype is np.float32:
            return self.product(x, name)
        y = self.product(g.op("Cast", x, to=self.wproto), name)
        return g.op("Cast", y, to=self.float)

    def product(self, x: str, name: str) -> str:
        g, t = self.g, self.t
        N, K = linear_shapes(self.c)[name]
        if f"{name}.zeros" in t:
            return self.int4_linear(x, name, N, K)
        if f"{name}.qweight" in t:          # int8 rows: W[n, k] = q[n, k] * s[n]
            q = g.weight(tensor_proto(f"{name}.q8", np.ascontiguousarray(np.asarray(t[f"{name}.qweight"]).T)))
            s = g.weight(tensor_proto(f"{name}.s8", np.asarray(t[f"{name}.scales"], self.wtype)))
            return g.op("MatMul", x, g.op("DequantizeLinear", q, s, axis=1))
        w = np.asarray(t[f"{name}.weight"])
        if name == "embed":                 # tied classifier: the gather table itself, [V, D] read transposed
            table = g.weight(tensor_proto("embed.table", w))
            return g.op("Gemm", x, table if w.dtype == self.wtype else g.op("Cast", table, to=self.wproto), transB=1)
        if w.dtype == np.float32 and self.wtype is np.float16:
            w = w.astype(np.float16)
        wt = g.weight(tensor_proto(f"{name}.wT", np.ascontiguousarray(w.T)))           # [K, N]
        return g.op("MatMul", x, wt if w.dtype == self.wtype else g.op("Cast", wt, to=self.wproto))

    def int4_linear(self, x: str, name: str, N: int, K: int) -> str:
        g, t = self.g, self.t
        q = unpack_int4(np.asarray(t[f"{name}.qweight"]))[:, :K].T                 # uint8 0..15 [K, N]
        scales = np.asarray(t[f"{name}.scales"], np.float32)                          # [N, ng]
        zeros = np.asarray(t[f"{name}.zeros"], np.float32)                            # [N, ng]
        num_groups = scales.shape[1]
        block = 2 * t[f"{name}.qweight"].shape[1] // num_groups                     # G = Kp / (Kp / G)
        s = g.weight(tensor_proto(f"{name}.scales", np.ascontiguousarray(scales.T).astype(self.wtype)))  # [ng, N]
        if self.o.zero_points == "onnx":
            z = g.weight(nibble_proto(f"{name}.zeros", np.ascontiguousarray(zeros.T).astype(np.uint8), signed=False))
            w = g.op("DequantizeLinear", g.weight(nibble_proto(f"{name}.q", q, signed=False)), s, z,
                     axis=0, block_size=block)
            return g.op("MatMul", x, w)
        w = g.op("DequantizeLinear", g.weight(nibble_proto(f"{name}.q", q ^ 8, signed=True)), s,
                 axis=0, block_size=block)                                            # (q - 8) * s
        y = g.op("MatMul", x, w)
        if np.all(zeros == 8):                                                        # symmetric: nothing to add
            return y
        offset = g.weight(tensor_proto(f"{name}.offset", np.ascontiguousarray(((8 - zeros) * scales).T)
                                       .astype(self.wtype)))
        return g.op("Add", y, g.op("MatMul", g.op("MatMul", x, self.group_ones(K, block, num_groups)), offset))

    def group_ones(self, K: int, block: int, num_groups: int) -> str:
        """float32 [K, ng]: column g sums the x entries of group g (shared by all matrices of this K)."""
        ones = (np.arange(K)[:, None] // block == np.arange(num_groups)[None, :]).astype(self.wtype)
        return self.g.weight(tensor_proto(f"group_ones.{K}.{block}", ones))

    def embedding(self, ids: str) -> str:
        g, t = self.g, self.t
        if "embed.weight" in t:
            table = g.weight(tensor_proto("embed.table", np.asarray(t["embed.weight"])))
            x = g.op("Gather", table, ids)
            if t["embed.weight"].dtype != np.float32:
                x = g.op("Cast", x, to=self.float)
        else:                                    # int8 / int4 tables: gathered from their float32 decoding
            decoded = decode_weight(t, "embed", linear_shapes(self.c)["embed"])
            x = g.op("Gather", g.weight(tensor_proto("embed.table", decoded)), ids)
        if self.c.embedding_multiplier != 1.0:
            x = g.op("Mul", x, g.const(self.c.embedding_multiplier, np.float32))
        return x

    def vector(self, name: str) -> str:
        return self.g.weight(tensor_proto(name, np.asarray(self.t[name], np.float32)))

    # ------------------------------------------------------------ layers

    def rms_norm(self, x: str, name: str) -> str:
        g = self.g
        ms = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
        rms = g.op("Sqrt", g.op("Add", ms, g.const(self.c.rms_norm_eps, np.float32)))
        return g.op("Mul", g.op("Div", x, rms), self.vector(name))

    def rope(self, x: str, cos: str, sin: str) -> str:
        """x: [B, S, H, hd]; cos/sin: [B, S, 1, hd/2] -> rotated (rotate-half layout)."""
        g, half = self.g, self.c.head_dim // 2
        x1, x2 = g.ops("Split", x, g.const([half, half]), num_outputs=2, axis=-1)
        first = g.op("Sub", g.op("Mul", x1, cos), g.op("Mul", x2, sin))
        second = g.op("Add", g.op("Mul", x2, cos), g.op("Mul", x1, sin))
        return g.op("Concat", first, second, axis=-1)

    def attention(self, i: int, x: str, step: dict) -> str:
        g, c = self.g, self.c
        group = c.num_heads // c.num_kv_heads
        qkv = self.linear(self.rms_norm(x, f"layers.{i}.attn_norm"), f"layers.{i}.qkv_proj")    # [B, S, q+2kv]
        if c.qkv_bias:
            qkv = g.op("Add", qkv, self.vector(f"layers.{i}.qkv_bias"))
        q, k, v = g.ops("Split", qkv, g.const([c.q_size, c.kv_size, c.kv_size]), num_outputs=3, axis=-1)
        q = g.op("Reshape", q, g.const([0, 0, c.num_heads, c.head_dim]))                  # [B, S, Hq, hd]
        k = g.op("Reshape", k, g.const([0, 0, c.num_kv_heads, c.head_dim]))               # [B, S, Hkv, hd]
        v = g.op("Reshape", v, g.const([0, 0, c.num_kv_heads, c.head_dim]))
        if c.qk_norm:                                                                       # per head, over hd
            q, k = self.rms_norm(q, f"layers.{i}.q_norm"), self.rms_norm(k, f"layers.{i}.k_norm")
        cos, sin = step["rope"][c.layer_rope_theta(i)]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        caches = []
        for kind, new in (("key", k), ("value", v)):          # [B, Hkv, S, hd] into [B, Hkv, max_len, hd]
            update = g.op("Transpose", new, perm=[0, 2, 1, 3])
            present = g.op("TensorScatter", f"past_{kind}.{i}", update, step["write_at"], axis=-2)
            g.rename(present, f"present_{kind}.{i}")
            caches.append(g.op("Unsqueeze", f"present_{kind}.{i}", g.const([2])))          # [B, Hkv, 1, C, hd]
        keys, values = caches
        qg = g.op("Transpose", g.op("Reshape", q, g.const([0, 0, c.num_kv_heads, group, c.head_dim])),
                  perm=[0, 2, 3, 1, 4])                                                     # [B, Hkv, group, S, hd]
        scores = g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 1, 2, 4, 3]))           # [B, Hkv, group, S, C]
        scores = self.softcap(g.op("Mul", scores, g.const(np.float32(c.softmax_scale), np.float32)),
                              c.attn_logit_softcap)
        mask = step["masks"][c.layer_window(i)]
        probs = g.op("Softmax", g.op("Where", mask, scores, g.const(MASKED, np.float32)), axis=-1)
        out = g.op("Transpose", g.op("MatMul", probs, values), perm=[0, 3, 1, 2, 4])         # [B, S, Hkv, group, hd]
        o = self.linear(g.op("Reshape", out, g.const([0, 0, c.q_size])), f"layers.{i}.o_proj")
        return self.rms_norm(o, f"layers.{i}.post_attn_norm") if c.post_norms else o

    def softcap(self, x: str, cap: Optional[float]) -> str:
        """Gemma 2's cap * tanh(x / cap); x itself when cap is None."""
        if cap is None:
            return x
        g, c32 = self.g, self.g.const(np.float32(cap), np.float32)
        return g.op("Mul", g.op("Tanh", g.op("Div", x, c32)), c32)

    def mlp(self, i: int, x: str) -> str:
        g, c = self.g, self.c
        gate_up = self.linear(self.rms_norm(x, f"layers.{i}.mlp_norm"), f"layers.{i}.gate_up_proj")
        gate, up = g.ops("Split", gate_up, g.const([c.intermediate_size] * 2), num_outputs=2, axis=-1)
        if c.activation == "silu":
            act = g.op("Mul", gate, g.op("Sigmoid", gate))
        else:
            act = g.op("Gelu", gate, approximate="tanh")
        y = self.linear(g.op("Mul", act, up), f"layers.{i}.down_proj")
        return self.rms_norm(y, f"layers.{i}.post_mlp_norm") if c.post_norms else y

    def step_inputs(self) -> dict:
        """Once per step: the RoPE tables of each base gathered at the positions (theta -> cos, sin:
        [B, S, 1, hd/2]), the write index, and the attention mask of each window (None: whole context)."""
        g, c = self.g, self.c
        rope = {}
        for theta in sorted({c.layer_rope_theta(i) for i in range(c.num_layers)}):
            tables = rope_cos_sin(rope_inv_freq(c, theta), np.arange(self.max_len))             # [max_len, hd/2]
            rope[theta] = tuple(g.op("Unsqueeze", g.op("Gather", g.weight(tensor_proto(f"rope.{kind}.{theta:g}", t)),
                                                       "positions"), g.const([2])) for kind, t in zip(("cos", "sin"),
                                                                                                     tables))
        write_at = g.op("Gather", "positions", g.const(0), axis=1)                              # [B]
        keys = g.const(np.arange(self.max_len).reshape(1, 1, 1, 1, -1))                         # [1, 1, 1, 1, C]
        pos = g.op("Unsqueeze", "positions", g.const([1, 2, 4]))                                # [B, 1, 1, S, 1]
        lens = g.op("Reshape", "seq_lens", g.const([-1, 1, 1, 1, 1]))
        causal = g.op("And", g.op("LessOrEqual", keys, pos), g.op("Less", keys, lens))          # [B, 1, 1, S, C]
        masks = {}
        for window in {c.layer_window(i) for i in range(c.num_layers)}:
            masks[window] = causal if window is None else \
                g.op("And", causal, g.op("Greater", keys, g.op("Sub", pos, g.const(window))))
        return {"rope": rope, "write_at": write_at, "masks": masks}

    def build(self, seq: Optional[int], name: str):
        g, c = self.g, self.c
        step = self.step_inputs()
        x = self.embedding("input_ids")                                                          # [B, S, D]
        for i in range(c.num_layers):
            x = g.op("Add", x, self.attention(i, x, step))
            x = g.op("Add", x, self.mlp(i, x))
        last = g.op("Sub", g.op("Sub", "seq_lens", g.const(1)), step["write_at"])              # [B] row of S
        rows = g.op("Expand", g.op("Reshape", last, g.const([-1, 1, 1])), g.const([1, 1, c.hidden_size]))
        h = g.op("Reshape", g.op("GatherElements", x, rows, axis=1), g.const([-1, c.hidden_size]))  # [B, D]
        head = "lm_head" if not c.tie_word_embeddings else "embed"
        logits = self.softcap(self.linear(self.rms_norm(h, "norm"), head), c.final_logit_softcap)    # [B, V]
        g.rename(logits, "logits")
        g.rename(g.op("Cast", g.op("ArgMax", "logits", axis=-1, keepdims=0), to=g.types.INT32), "next_token")
        return g.model(name, self.inputs(seq), self.outputs(), OPSET, __doc__.splitlines()[0])

    def inputs(self, seq: Optional[int]) -> list:
        c, S, vi = self.c, seq if seq is not None else "seq", self.g.value_info
        cache = ["batch", c.num_kv_heads, self.max_len, c.head_dim]
        out = [vi("input_ids", "INT64", ["batch", S]), vi("positions", "INT64", ["batch", S]),
               vi("seq_lens", "INT64", ["batch"])]
        for i in range(c.num_layers):
            out += [vi(f"past_key.{i}", "FLOAT", cache), vi(f"past_value.{i}", "FLOAT", cache)]
        return out

    def outputs(self) -> list:
        c, vi = self.c, self.g.value_info
        cache = ["batch", c.num_kv_heads, self.max_len, c.head_dim]
        out = [vi("logits", "FLOAT", ["batch", c.vocab_size]), vi("next_token", "INT32", ["batch"])]
        for i in range(c.num_layers):
            out += [vi(f"present_key.{i}", "FLOAT", cache), vi(f"present_value.{i}", "FLOAT", cache)]
        return out


# ------------------------------------------------------------ files

GRAPHS = {"decode": 1, "prefill": None}          # graph name -> fixed new tokens per sequence (None: any)


def export_onnx(config: ModelConfig, tensors: Mapping[str, np.ndarray], out_dir,
                options: OnnxExportOptions = OnnxExportOptions(), engine_info: Optional[dict] = None) -> dict:
    """Write decode.onnx, prefill.onnx, weights.bin and export.json into out_dir. -> the export.json dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_len = options.max_len or min(config.max_position_embeddings, DEFAULT_MAX_LEN)
    weights = WeightsFile(out / "weights.bin")
    for name, seq in GRAPHS.items():
        graph = ModelGraph(config, tensors, options, max_len)
        model = graph.build(seq, f"tokenwire_{name}")
        weights.externalize(model, graph.g.weights)
        load_onnx().save_model(model, str(out / f"{name}.onnx"))
    manifest = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "opset": OPSET, "max_len": max_len,
                "options": asdict(options), "model": config.to_dict(), "engine": engine_info or {},
                "graphs": {name: f"{name}.onnx" for name in GRAPHS},
                "files": {f.name: sha256_file(f) for f in sorted(out.iterdir())
                          if f.suffix in (".onnx", ".bin")}}
    manifest["sha256"] = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
    (out / "export.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def export_engine(engine, out_dir, options: OnnxExportOptions = OnnxExportOptions()) -> dict:
    """A loaded engine (kernels/engine_format.Engine) -> export_onnx, recording which engine it came from."""
    m = engine.manifest
    info = {"name": engine.name, "path": str(engine.path), "quantization": m.get("quantization"),
            "source_sha256": m.get("source", {}).get("sha256")}
    return export_onnx(engine.config, engine.tensors, out_dir, options, info)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_export(out_dir) -> dict:
    """export.json, after checking its format and version."""
    path = Path(out_dir) / "export.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a tokenwire ONNX export ({exc})") from None
    if manifest.get("format") != EXPORT_FORMAT or manifest.get("version") != EXPORT_VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                         f"this tokenwire reads {EXPORT_FORMAT!r} version {EXPORT_VERSION}")
    return manifest
