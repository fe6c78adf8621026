"""INT4 weight-only quantizer: dense engine tensors in, the encodings of docs/ENGINE_FORMAT.md out.

Contract:
- Input: a ModelConfig and its canonical float tensors (engine_build/source.py: `embed`,
  `layers.{i}.qkv_proj`, ... float [N, K]; norms and biases float32), as the importers
  produce them.
- `quantize_model(config, tensors, options, calibration_token_ids, progress)` returns
  `(encoded_tensors, tensor_meta, report)`: the tensors to write, the manifest's "tensors"
  entry, and a `QuantReport` (per-tensor errors; report.py adds perplexity).
- Each weight goes through the chain of small pure steps in int4.py (`pad_k` ->
  `get_group_qparams` -> `quantize` -> `pack`); the searches of quant_search.py only choose
  its clip ratios, input scales or (GPTQ) the order errors are absorbed in.

Algorithms (`QuantOptions.algorithm`):
- "rtn":  round to nearest over each group's full [min, max] range.
- "clip": per group, shrink the range by the ratio in CLIP_RATIOS that minimises the group's
          output error on calibration activations, (w - w_hat)^T (X^T X) (w - w_hat);
          plain weight MSE when no calibration data is given.
- "awq":  activation-aware per-input-channel scaling first (AWQ): W' = W diag(s), with
          s = mean|x|^alpha and alpha searched on the calibration activations to minimise
          ||X W^T - (X/s) Q(W')^T||; 1/s is folded exactly into whatever produces x (the
          RMSNorm weight for qkv and gate_up, the V rows for o_proj, the up rows for
          down_proj), then "clip" on the scaled weight. Needs calibration tokens.
- "gptq": GPTQ: columns quantized in order, each one's error pushed onto the columns not yet
          quantized through the inverse of H = X^T X; group ranges clip-searched.
- "awq_gptq": the AWQ fold, then GPTQ on the scaled weights.
The quantizer's report (see sweep.py) has the measured table; "awq" is the
default: on stories260K at G=64 it gave the lowest perplexity increase, while the GPTQ
variants give the lowest per-projection output error (and the best perplexity at G=32).
"""

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
from tqdm import tqdm

from ..core.config import ModelConfig
from ..core.errors import BuildError
from ..kernels.engine_format import linear_shapes, vector_shapes
from .calibration import capture_activations, fold_awq_layer
from .imported import ImportedInt4
from .int4 import dequantize, quantize_int4, quantize_int8
from .quant_search import awq_input_scales, gptq_int4, group_gram, search_clip
from .report import evaluate_model

GROUP_SIZES = (32, 64, 128)
# Default 64, from the stories260K sweep (python -m tokenwire.engine_build.sweep; AWQ, perplexity
# increase on the shipped eval text): G=32 +5.5% at 5.0 bits/weight (fp16 scale + zero per group),
# G=64 +6.1% at 4.5 bits, G=128 +6.7% at 4.25 bits. 64 keeps most of 32's quality for 10% fewer
# bytes, which is what a bandwidth-bound decode pays for; 128 saves little more and, on models as
# narrow as 64 (stories260K), pads every row to 128 columns and saves nothing at all.
DEFAULT_GROUP_SIZE = 64
ALGORITHMS = ("rtn", "clip", "awq", "gptq", "awq_gptq")
DEFAULT_ALGORITHM = "awq"
NEEDS_CALIBRATION = ("awq", "gptq", "awq_gptq")
METHODS = ("none", "int4")
PRECISIONS = ("fp32", "fp16", "int8", "int4")          # for embedding and lm_head
FLOAT_DTYPES = {"fp32": np.float32, "fp16": np.float16}
# TensorError.origin: "exact" / "mapped": a pre-quantized source's codes taken as they are (imported.py);
# "requantized": a quantized source's weights dequantized and quantized again; "quantized": float
# weights quantized here; "float": stored as float (converted from whatever the source held).
ORIGINS = ("exact", "mapped", "requantized", "quantized", "float")


@dataclass(frozen=True)
class QuantOptions:
    method: str = "int4"                 # "none": every matrix dense
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool = False              # True: zero point 8 everywhere, scale from max |w|
    algorithm: str = DEFAULT_ALGORITHM
    embedding: Optional[str] = None      # None: fp32 with method "none", fp16 with "int4"
    lm_head: Optional[str] = None        # same; ignored when the embedding is tied

    def __post_init__(self):
        _check(self.method in METHODS, f"quantization method must be one of {METHODS}, got {self.method!r}")
        _check(self.group_size in GROUP_SIZES, f"group size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        _check(self.algorithm in ALGORITHMS, f"quantization algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        for part in ("embedding", "lm_head"):
            value = getattr(self, part)
            _check(value is None or value in PRECISIONS, f"{part} precision must be one of {PRECISIONS}, got {value!r}")

    def precision(self, part: str) -> str:
        """The encoding of "embedding" or "lm_head"."""
        chosen = getattr(self, part)
        return chosen or ("fp32" if self.method == "none" else "fp16")

    def manifest(self) -> dict:
        """engine.json "quantization"."""
        return {"method": self.method, "group_size": self.group_size, "symmetric": self.symmetric,
                "algorithm": "none" if self.method == "none" else self.algorithm,
                "embedding": self.precision("embedding"), "lm_head": self.precision("lm_head")}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BuildError(None, message)


# ---------------------------------------------------------------------- the whole model

@dataclass
class TensorError:
    name: str
    encoding: str                        # "int4", "int8", "fp16" or "fp32"
    shape: tuple                         # logical [N, K]
    weight_rel_error: float              # ||W - W_hat|| / ||W||, W_hat mapped back to the original basis
    output_rel_error: Optional[float]    # ||X W^T - X W_hat^T|| / ||X W^T|| on held-out calibration rows
    origin: str = "quantized"            # ORIGINS: how the stored encoding relates to the source's weights
    source: Optional[str] = None         # what the source held, for pre-quantized sources ("gguf Q4_0", "awq")


@dataclass
class QuantReport:
    quantization: dict                   # QuantOptions.manifest()
    num_calibration_tokens: int
    tensors: list = field(default_factory=list)      # [TensorError]
    evaluation: Optional[dict] = None                # report.evaluate_model(...).to_dict(), when run

    def mean_output_error(self) -> Optional[float]:
        errs = [t.output_rel_error for t in self.tensors if t.encoding == "int4" and t.output_rel_error is not None]
        return float(np.mean(errs)) if errs else None

    def mean_weight_error(self) -> Optional[float]:
        errs = [t.weight_rel_error for t in self.tensors if t.encoding == "int4"]
        return float(np.mean(errs)) if errs else None

    def to_dict(self) -> dict:
        return {"quantization": self.quantization, "num_calibration_tokens": self.num_calibration_tokens,
                "mean_weight_rel_error": self.mean_weight_error(), "mean_output_rel_error": self.mean_output_error(),
                "tensors": {t.name: _tensor_row(t) for t in self.tensors},
                "evaluation": self.evaluation}


def _tensor_row(t: TensorError) -> dict:
    row = {"encoding": t.encoding, "origin": t.origin, "weight_rel_error": t.weight_rel_error,
           "output_rel_error": t.output_rel_error}
    return row if t.source is None else {**row, "source": t.source}


def quantize_model(config: ModelConfig, tensors: Mapping[str, np.ndarray], options: QuantOptions = QuantOptions(),
                   calibration_token_ids: Optional[Sequence[Sequence[int]]] = None, progress: bool = False,
                   evaluation_token_ids: Optional[Sequence[Sequence[int]]] = None,
                   imported: Optional[ImportedInt4] = None):
    """Canonical float tensors (engine_build/source.py) -> (encoded_tensors, tensor_meta, QuantReport).

    encoded_tensors: engine names and encodings of docs/ENGINE_FORMAT.md, ready to write.
    tensor_meta: the manifest's "tensors" entry. calibration_token_ids: token sequences
    (each at most max_position_embeddings long; see calibration.split_sequences) for "clip"
    and "awq" ("awq" requires them); with "rtn" they only feed the report's output errors.
    evaluation_token_ids: sequences of a different text; when given (int4 only), the report's
    `evaluation` holds float vs quantized perplexity on it (report.evaluate_model).
    imported: a pre-quantized source's INT4 codes (imported.py), stored as they are wherever the
    encoding is int4; `tensors` is then the source's own dequantization, and the measure of each.
    """
    if options.algorithm in NEEDS_CALIBRATION and options.method == "int4" and not calibration_token_ids:
        raise BuildError(None, "the awq algorithm needs calibration text (or choose the rtn or clip algorithm)")
    acts = {}
    if options.method == "int4" and calibration_token_ids:
        acts = capture_activations(config, dense_engine_tensors(config, tensors), calibration_token_ids, progress)
    encoded, meta, report = encode_model(config, tensors, options, acts, progress, imported)
    report.num_calibration_tokens = sum(len(s) for s in calibration_token_ids or ())
    if evaluation_token_ids and options.method == "int4":
        report.evaluation = evaluate_model(config, dense_engine_tensors(config, tensors), encoded,
                                           evaluation_token_ids, progress=progress).to_dict()
    return encoded, meta, report


def encode_model(config: ModelConfig, tensors: Mapping[str, np.ndarray], options: QuantOptions,
                 acts: Mapping, progress: bool = False, imported: Optional[ImportedInt4] = None):
    """quantize_model with the calibration activations already captured (a sweep captures once).

    Works one layer at a time: only one layer's float matrices are held at once.
    """
    if options.algorithm in NEEDS_CALIBRATION and options.method == "int4" and not acts:
        raise BuildError(None, "the awq algorithm needs calibration activations")
    if imported is not None and imported.loaders and options.method == "int4" and options.algorithm in ("awq", "awq_gptq"):
        raise BuildError(None, "the awq algorithm rescales norms and weights together, which would change "
                               "pre-quantized weights; use rtn, clip or gptq for the rest")
    if imported is not None and imported.loaders and options.method == "int4" and options.group_size != imported.group_size:
        raise BuildError(None, f"the source is quantized in groups of {imported.group_size}, "
                               f"the build asks for groups of {options.group_size}")
    vectors = {name: _read_vector(tensors, name, shape) for name, shape in vector_shapes(config).items()}
    report = QuantReport(options.manifest(), 0)
    encoded, meta = {}, {}
    bar = tqdm(total=len(linear_shapes(config)), desc="quantizing", unit="tensor", disable=not progress)
    for names in _matrix_groups(config):
        weights = {name: _read_matrix(tensors, name, config) for name in names}
        folded = {}
        if options.method == "int4" and options.algorithm in ("awq", "awq_gptq") and names[0].startswith("layers."):
            folded = fold_awq_layer(config, int(names[0].split(".")[1]), weights, vectors, acts, _awq_search(options))
        for name in names:
            _encode_matrix(name, weights[name], folded.get(name, (None, None)), tensors, config, options,
                           acts.get(name), encoded, meta, report, imported)
            bar.update()
    bar.close()
    encoded.update(vectors)
    meta.update({name: {"kind": "dense", "shape": list(shape)} for name, shape in vector_shapes(config).items()})
    return encoded, meta, report


def dense_engine_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Canonical float tensors -> the engine names of a dense (method "none") engine, without converting."""
    out = {f"{name}.weight": tensors[name] for name in linear_shapes(config)}
    out.update({name: tensors[name] for name in vector_shapes(config)})
    return out


def _matrix_groups(config: ModelConfig) -> list:
    """Matrices in the order they are quantized: embed, each layer's four together, lm_head."""
    groups = [["embed"]] + [[f"layers.{i}.{n}" for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
                            for i in range(config.num_layers)]
    return groups + ([] if config.tie_word_embeddings else [["lm_head"]])


def _encode_matrix(name, w, scales, tensors, config, options, acts, encoded, meta, report, imported=None) -> None:
    """Encode one (possibly AWQ-scaled) matrix into `encoded`, and record its error."""
    row, col = scales
    shape = linear_shapes(config)[name]
    encoding = _encoding(name, options)
    x = None if acts is None else (acts.fit if col is None else acts.fit / col)
    codes = imported.load(name) if imported is not None and encoding == "int4" and name in imported.loaders else None
    parts = codes.engine_parts() if codes is not None else _encode(w, encoding, options, x)
    encoded.update({f"{name}.{part}": a for part, a in parts.items()})
    meta[name] = {"kind": "dense" if encoding in FLOAT_DTYPES else encoding, "shape": list(shape)}
    w_hat = dequantize(parts, shape[1]) if "qweight" in parts else parts["weight"]
    original = w if row is None and col is None else _read_matrix(tensors, name, config)
    error = _tensor_error(name, encoding, original, _original_basis(w_hat, row, col), acts)
    error.source = None if imported is None else imported.notes.get(name)
    error.origin = codes.origin if codes is not None else _origin(name, encoding, imported)
    report.tensors.append(error)


def _origin(name: str, encoding: str, imported: Optional[ImportedInt4]) -> str:
    if encoding in FLOAT_DTYPES:
        return "float"
    return "requantized" if imported is not None and name in imported.quantized else "quantized"


def _read_matrix(tensors, name, config) -> np.ndarray:
    shape = linear_shapes(config)[name]
    if name not in tensors:
        raise BuildError(None, f"source tensor {name!r} is missing")
    w = np.array(tensors[name], dtype=np.float32)     # a copy: AWQ rescales it
    if w.shape != tuple(shape):
        raise BuildError(None, f"source tensor {name!r} has shape {list(w.shape)}, the config needs {list(shape)}")
    if not np.all(np.isfinite(w)):
        raise BuildError(None, f"source tensor {name!r} holds NaN or infinite values")
    return w


def _read_vector(tensors, name, shape) -> np.ndarray:
    if name not in tensors:
        raise BuildError(None, f"source tensor {name!r} is missing")
    v = np.array(tensors[name], dtype=np.float32)
    if v.shape != tuple(shape):
        raise BuildError(None, f"source tensor {name!r} has shape {list(v.shape)}, the config needs {list(shape)}")
    return v


def _encoding(name: str, options: QuantOptions) -> str:
    if name in ("embed", "lm_head"):
        return options.precision("embedding" if name == "embed" else "lm_head")
    return "int4" if options.method == "int4" else "fp32"


def _encode(w: np.ndarray, encoding: str, options: QuantOptions, x: Optional[np.ndarray]) -> dict:
    """x: calibration inputs [T, K] in the basis of the stored (AWQ-scaled) weight, or None."""
    if encoding in FLOAT_DTYPES:
        return {"weight": w.astype(FLOAT_DTYPES[encoding])}
    if encoding == "int8":
        return quantize_int8(w)
    if options.algorithm == "rtn":
        return quantize_int4(w, options.group_size, options.symmetric)
    if options.algorithm in ("gptq", "awq_gptq") and x is not None:
        return gptq_int4(w, x, options.group_size, options.symmetric)
    clip = search_clip(w, group_gram(x, w.shape[1], options.group_size), options.group_size, options.symmetric)
    return quantize_int4(w, options.group_size, options.symmetric, clip)


def _awq_search(options: QuantOptions):
    def search(w, x, tie=None):
        return awq_input_scales(w, x, options.group_size, options.symmetric, tie)
    return search


def _original_basis(w_hat: np.ndarray, row, col) -> np.ndarray:
    """Undo the AWQ fold: stored = diag(row) W diag(col)."""
    w_hat = np.asarray(w_hat, dtype=np.float32)
    if row is not None:
        w_hat = w_hat / row[:, None]
    return w_hat if col is None else w_hat / col


def _tensor_error(name, encoding, w, w_hat, acts) -> TensorError:
    weight_err = float(np.linalg.norm(w - w_hat) / max(np.linalg.norm(w), 1e-30))
    output_err = None
    if acts is not None:
        y = acts.held_out @ w.T
        output_err = float(np.linalg.norm(y - acts.held_out @ w_hat.T) / max(np.linalg.norm(y), 1e-30))
    return TensorError(name, encoding, tuple(w.shape), weight_err, output_err)
