"""Checks of an ONNX export: the operators TensorRT takes, and onnxruntime as the CPU oracle.

- `TRT_OPS`: the operators the exporter may emit, each listed as supported ("Y") in
  onnx-tensorrt's docs/operators.md for TensorRT 10.15 (opsets 9 to 24), with the
  restrictions that document states for it. `trt_problems(model)` lists every node outside
  the set or breaking a restriction; an empty list is what a TensorRT build needs from us.
- `OrtModel(export_dir)`: onnxruntime (CPU) sessions over decode.onnx and prefill.onnx with
  numpy KV caches of `max_slots` sequences; `prefill` and `decode` return logits and greedy
  ids. ORT's QDQ fusion is switched off (`session.disable_quant_qdq`): it rewrites
  DequantizeLinear + MatMul into its own 4-bit kernel with lower-precision arithmetic
  (1e-2 relative error measured on a toy model), and the point here is to run our graph as
  written.
"""

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from .onnx_export import read_export

# operator -> restriction the TensorRT 10.15 support matrix states (None: none that we could break)
TRT_OPS = {
    "Add": None, "And": None, "ArgMax": None, "Cast": None, "Concat": None, "Div": None, "Expand": None,
    "Gather": None, "GatherElements": None, "Gelu": None, "Gemm": None, "Greater": None, "Less": None, "LessOrEqual": None,
    "MatMul": None, "Mul": None, "Reshape": None, "Sigmoid": None, "Softmax": None, "Sqrt": None, "Sub": None,
    "Tanh": None, "Transpose": None, "Unsqueeze": "axes must be a constant", "Split": None, "Where": None,
    "ReduceMean": "axes must be an initializer",
    "DequantizeLinear": "x_zero_point must be zero (INT8, FP8, FP4, INT4); INT4 block sizes 64 or 128, along one "
                        "of the last two dimensions (TensorRT's quantized-types guide)",
    "TensorScatter": "past_cache and update must be 4D; axis must be -2",
}
TRT_OPS_SOURCE = ("onnx/onnx-tensorrt docs/operators.md, 'TensorRT 10.15 supports operators ... opset 9 to opset 24'; "
                  "INT4 block sizes: TensorRT's 'Quantization Schemes' page")
TRT_INT4_BLOCK_SIZES = (64, 128)


def trt_problems(model: onnx.ModelProto) -> list:
    """Every node TensorRT's ONNX parser would refuse, as readable lines (empty: none)."""
    constants = {t.name for t in model.graph.initializer}
    problems = []
    for node in model.graph.node:
        where = f"{node.name} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            problems.append(f"{where}: custom domain {node.domain!r}")
        elif node.op_type not in TRT_OPS:
            problems.append(f"{where}: not in the TensorRT-supported set")
        elif node.op_type == "DequantizeLinear" and len(node.input) > 2 and node.input[2]:
            problems.append(f"{where}: has a zero point ({TRT_OPS['DequantizeLinear']})")
        elif node.op_type == "DequantizeLinear" and _attr(node, "block_size") not in (None, 0, *TRT_INT4_BLOCK_SIZES):
            problems.append(f"{where}: INT4 block size {_attr(node, 'block_size')} ({TRT_OPS['DequantizeLinear']})")
        elif node.op_type == "TensorScatter" and _attr(node, "axis") != -2:
            problems.append(f"{where}: {TRT_OPS['TensorScatter']}")
        elif node.op_type in ("ReduceMean", "Unsqueeze") and node.input[1] not in constants:
            problems.append(f"{where}: {TRT_OPS[node.op_type]}")
    return problems


def _attr(node, name):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


class OrtModel:
    """The exported graphs on onnxruntime's CPU provider, with numpy caches (tests and checks)."""

    def __init__(self, export_dir, max_slots: int = 4):
        import onnxruntime as ort
        path = Path(export_dir)
        self.manifest = read_export(path)
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
        opts.log_severity_level = 3                     # no warning per TensorScatter copy
        self.sessions = {name: ort.InferenceSession(str(path / file), opts, providers=["CPUExecutionProvider"])
                         for name, file in self.manifest["graphs"].items()}
        m = self.manifest["model"]
        self.num_layers, self.max_len = m["num_layers"], self.manifest["max_len"]
        shape = (max_slots, m["num_kv_heads"], self.max_len, m["head_dim"])
        self.keys = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]     # [slots, Hkv, C, hd] each
        self.values = [np.zeros(shape, np.float32) for _ in range(self.num_layers)]

    def run(self, graph: str, slots: Sequence[int], ids: np.ndarray, positions: np.ndarray, seq_lens) -> tuple:
        """One step of the sequences in cache `slots`. ids/positions: int [B, S]. -> (logits [B, V], ids [B])"""
        feeds = {"input_ids": np.asarray(ids, np.int64), "positions": np.asarray(positions, np.int64),
                 "seq_lens": np.asarray(seq_lens, np.int64)}
        rows = list(slots)
        for i in range(self.num_layers):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = self.keys[i][rows], self.values[i][rows]
        logits, next_ids, *caches = self.sessions[graph].run(None, feeds)
        for i in range(self.num_layers):
            self.keys[i][rows], self.values[i][rows] = caches[2 * i], caches[2 * i + 1]
        return logits, next_ids

    def prefill(self, slot: int, ids: Sequence[int], start_pos: int = 0) -> tuple:
        """A chunk of one sequence at start_pos.. -> (logits [V], greedy id)"""
        n = len(ids)
        logits, next_ids = self.run("prefill", [slot], np.array([ids]), np.arange(start_pos, start_pos + n)[None],
                                    [start_pos + n])
        return logits[0], int(next_ids[0])

    def decode(self, slots: Sequence[int], ids: Sequence[int], positions: Sequence[int]) -> tuple:
        """One token for each sequence. -> (logits [B, V], greedy ids [B])"""
        pos = np.asarray(positions)
        return self.run("decode", slots, np.asarray(ids)[:, None], pos[:, None], pos + 1)

    def greedy(self, prompt: Sequence[int], num_new: int, slot: int = 0) -> list:
        _, token = self.prefill(slot, prompt)
        out = [token]
        for pos in range(len(prompt), len(prompt) + num_new - 1):
            _, ids = self.decode([slot], [out[-1]], [pos])
            out.append(int(ids[0]))
        return out
