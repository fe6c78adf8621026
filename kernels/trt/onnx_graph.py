"""A small ONNX graph builder and the weights file two exported graphs share.

Contract:
- `GraphBuilder` collects nodes, small constants (stored inside the model) and weights
  (stored outside, in the shared weights file); `op(type, *inputs, **attrs)` adds one node
  and returns its output name (`ops(..., num_outputs=n)` for several). Names are made
  from a counter, so building the same model twice gives the same graph.
- `WeightsFile` appends each weight's raw bytes once, 64-byte aligned, and points any
  number of graphs at them through ONNX external data (`location`, `offset`, `length`):
  the decode and the prefill graph of one engine hold their weights once on disk.
- 4-bit tensors are packed the way ONNX stores INT4/UINT4: two per byte in row-major
  order, the first element in the low nibble.

Only the `onnx` package is needed (no torch, no runtime). It is an optional dependency, loaded
by `load_onnx()` when a graph is built, so importing the TensorRT backend costs nothing.
"""

from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np

INLINE_LIMIT = 1024          # bytes: constants at most this size live inside the .onnx file
ALIGNMENT = 64               # each weight starts at a multiple of this in the weights file
NUMPY_TYPES = {np.float32: "FLOAT", np.float16: "FLOAT16", np.int64: "INT64", np.int32: "INT32", np.int8: "INT8",
               np.uint8: "UINT8", np.bool_: "BOOL"}     # numpy type -> onnx.TensorProto's name for it


def load_onnx():
    """The onnx package (optional: pip install onnx), or ValueError saying so."""
    try:
        import onnx
    except ImportError:
        raise ValueError("the ONNX export needs the onnx package: pip install onnx") from None
    return onnx


def pack_nibbles(values: np.ndarray) -> bytes:
    """uint8 values 0..15 of any shape -> ONNX INT4/UINT4 raw bytes (row-major, low nibble first)."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def tensor_proto(name: str, array: np.ndarray):
    """A numpy array -> onnx.TensorProto (raw bytes)."""
    onnx = load_onnx()
    array = np.asarray(array)             # (np.ascontiguousarray would make a scalar 1-D)
    kind = getattr(onnx.TensorProto, NUMPY_TYPES[array.dtype.type])
    return onnx.helper.make_tensor(name, kind, array.shape, array.tobytes(order="C"), raw=True)


def nibble_proto(name: str, values: np.ndarray, signed: bool):
    """values: uint8 holding two's-complement nibbles (signed) or 0..15 (unsigned), any shape."""
    onnx = load_onnx()
    kind = onnx.TensorProto.INT4 if signed else onnx.TensorProto.UINT4
    return onnx.helper.make_tensor(name, kind, values.shape, pack_nibbles(values), raw=True)


class GraphBuilder:
    def __init__(self):
        self.onnx = load_onnx()
        self.types = self.onnx.TensorProto           # element type codes: self.types.FLOAT, ...
        self.nodes = []
        self.constants: Dict[str, object] = {}        # inline TensorProtos: shapes, axes, scalars
        self.weights: Dict[str, object] = {}          # external TensorProtos: everything the engine stores
        self.num_names = 0

    def fresh(self, hint: str) -> str:
        self.num_names += 1
        return f"{hint}_{self.num_names}"

    def const(self, array, dtype=np.int64) -> str:
        """A small constant (axes, shapes, scalars), one per distinct value."""
        array = np.asarray(array, dtype=dtype)
        name = f"const_{array.dtype.name}_{'x'.join(map(str, array.shape))}_{array.tobytes().hex()}"
        if name not in self.constants:
            self.constants[name] = tensor_proto(name, array)
        return name

    def weight(self, proto) -> str:
        """A weight tensor, by its (engine-derived) name; added once."""
        self.weights.setdefault(proto.name, proto)
        return proto.name

    def op(self, op_type: str, *inputs: str, name_hint: str = "", **attrs) -> str:
        return self.ops(op_type, *inputs, num_outputs=1, name_hint=name_hint, **attrs)[0]

    def ops(self, op_type: str, *inputs: str, num_outputs: int, name_hint: str = "", **attrs) -> list:
        outputs = [self.fresh(name_hint or op_type) for _ in range(num_outputs)]
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), outputs, name=self.fresh(f"n_{op_type}"),
                                                     **attrs))
        return outputs

    def rename(self, value: str, name: str) -> None:
        """Make the node producing `value` write a graph output called `name` instead."""
        for node in self.nodes:
            for i, out in enumerate(node.output):
                if out == value:
                    node.output[i] = name
            for i, inp in enumerate(node.input):
                if inp == value:
                    node.input[i] = name

    def value_info(self, name: str, kind: str, dims: Sequence):
        """A graph input or output: `kind` is a TensorProto type name ("FLOAT", "INT64", ...)."""
        return self.onnx.helper.make_tensor_value_info(name, getattr(self.types, kind), list(dims))

    def model(self, name: str, inputs: Sequence, outputs: Sequence, opset: int, doc: str):
        helper = self.onnx.helper
        graph = helper.make_graph(self.nodes, name, list(inputs), list(outputs),
                                  initializer=list(self.weights.values()) + list(self.constants.values()),
                                  doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tokenwire")
        model.ir_version = helper.find_min_ir_version_for(model.opset_import)
        return model


class WeightsFile:
    """One file of raw weight bytes that several exported graphs point into."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.placed: Dict[str, Tuple[int, int]] = {}    # name -> (offset, length)
        self.path.write_bytes(b"")
        self.size = 0

    def externalize(self, model, names) -> None:
        """Move the named initializers' bytes into the file (once each) and point `model` at them."""
        external = load_onnx().TensorProto.EXTERNAL
        names = set(names)
        with self.path.open("ab") as f:
            for tensor in model.graph.initializer:
                if tensor.name not in names or len(tensor.raw_data) <= INLINE_LIMIT:
                    continue
                raw = tensor.raw_data
                if tensor.name not in self.placed:
                    pad = -self.size % ALIGNMENT
                    f.write(b"\0" * pad)
                    self.size += pad
                    f.write(raw)
                    self.placed[tensor.name] = (self.size, len(raw))
                    self.size += len(raw)
                offset, length = self.placed[tensor.name]
                assert length == len(raw), f"weight {tensor.name} differs between graphs"
                tensor.ClearField("raw_data")
                tensor.data_location = external
                del tensor.external_data[:]
                for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
