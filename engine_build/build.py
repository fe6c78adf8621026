"""The build pipeline: open a source -> quantize -> write the engine directory.

    source = open_source("Qwen/Qwen2.5-0.5B-Instruct")     # HF dir, hub name or llama2.c .bin
    build_engine(source, "out/qwen", BuildOptions())       # -> Path of the engine directory

Stages, each one call: an importer (hf.py, gguf_import.py, llama2c.py) gives a `SourceModel`; the quant
teammate's `quantize.quantize_model(config, tensors, options, calibration_ids, progress)`
encodes every tensor and measures its error; with `evaluate`, `report.evaluate_model` adds the
float-vs-quantized perplexity on held-out text; `engine_format.write_engine` writes it all atomically.
"""

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from tokenizers import Tokenizer

from ..core.errors import BuildError
from . import hub
from .calibration import default_calibration_text, default_eval_text, split_sequences
from .engine_writer import write_engine
from .gguf_import import import_gguf, is_gguf
from .hf import import_hf
from .llama2c import import_llama2c
from .quantize import QuantOptions, dense_engine_tensors, quantize_model
from .report import evaluate_model
from .source import SourceModel, file_stamp, sha256_files

CALIBRATION_WINDOW = 512        # tokens per calibration sequence (fewer when the model has fewer positions)
SOURCE_RULES = 2                # what options_for_source decides for a source; bumped when that changes, so a
                                # cached engine built under the old rules is rebuilt (2: quantized embeddings -> int8)


@dataclass(frozen=True)
class BuildOptions:
    quant: QuantOptions = field(default_factory=QuantOptions)
    tokenizer: Optional[str] = None      # llama2.c: the vocabulary (.bin or .model); default: beside the checkpoint
    calibration: Optional[str] = None    # calibration text file; default: engine_build/data/calibration.txt
    evaluate: bool = False               # also score float vs quantized on the shipped eval text (report.py)

    def cache_key(self) -> dict:
        """What changes the engine's bytes (for resolve.py's cache)."""
        d = asdict(self)
        d["source_rules"] = SOURCE_RULES
        d["quant"] = self.quant.manifest()
        if d["calibration"]:
            d["calibration_sha256"] = sha256_files([d["calibration"]])
        return d


def open_source(spec, tokenizer: Optional[str] = None) -> SourceModel:
    """A Hugging Face directory, a hub name (`org/name`), a GGUF file or a llama2.c checkpoint file -> SourceModel."""
    path = Path(spec)
    if path.is_file() and (path.suffix == ".gguf" or is_gguf(path)):
        if tokenizer is not None:
            raise BuildError(spec, "--tokenizer applies to llama2.c checkpoints only; a GGUF file carries its tokenizer")
        return import_gguf(path)
    if path.is_file():
        _check_checkpoint_file(path)
        return import_llama2c(path, tokenizer=tokenizer)
    if tokenizer is not None and (path.is_dir() or hub.looks_like_hub_name(str(spec))):
        raise BuildError(spec, "--tokenizer applies to llama2.c checkpoints only; a Hugging Face model "
                               "brings its own tokenizer.json")
    if path.is_dir():
        if (path / "engine.json").exists():
            raise BuildError(path, "is already a tokenwire engine directory (serve it directly)")
        return import_hf(path)
    if hub.looks_like_hub_name(str(spec)):
        try:
            return import_hf(hub.download(str(spec)), kind="hub", name=str(spec))
        except BuildError as exc:           # a mistyped local path looks like org/name too: say that first
            raise BuildError(spec, f"no such file or directory here; as a Hugging Face hub name: "
                                   f"{exc.problem}") from None
    raise BuildError(spec, "no such file or directory, and not a Hugging Face hub name (org/name)")


def _check_checkpoint_file(path: Path) -> None:
    """A single file is a llama2.c checkpoint; say so when it is plainly something else."""
    hints = {".safetensors": "pass the Hugging Face model directory that holds it (with config.json)",
             ".json": "pass the Hugging Face model directory that holds it",
             ".pt": "PyTorch checkpoints are not supported; use safetensors or llama2.c's export.py",
             ".pth": "PyTorch checkpoints are not supported; use safetensors or llama2.c's export.py"}
    if path.suffix in hints:
        raise BuildError(path, f"not a llama2.c checkpoint: {hints[path.suffix]}")


def build_engine(source: SourceModel, out_dir, options: BuildOptions = BuildOptions(), progress: bool = False,
                 log: Callable[[str], None] = lambda line: None, exists: str = "error") -> Path:
    """Quantize `source` and write the engine directory `out_dir` (`exists`: see write_engine). -> out_dir"""
    config = source.config
    options = options_for_source(options, source, log)
    calibration = calibration_sequences(source, options) if _needs_calibration(options) else None
    log(f"quantizing {source.name}: {options.quant.manifest()}")
    encoded, meta, report = quantize_model(config, source.tensors, options.quant, calibration, progress,
                                           imported=source.imported)
    if options.evaluate and options.quant.method != "none":
        report.evaluation = evaluate(source, encoded, progress)
    manifest_source = {"path": str(source.path), "kind": source.kind,
                       "sha256": source.checksum or sha256_files(source.files),
                       "files": [file_stamp(p) for p in source.files]}
    return write_engine(out_dir, name=source.name, description=source.description or _describe(source, options),
                        config=config, quantization=options.quant.manifest(), tokenizer=source.tokenizer,
                        source=manifest_source, tensors=encoded, tensor_meta=meta, report=report.to_dict(),
                        exists=exists)


def options_for_source(options: BuildOptions, source: SourceModel, log=lambda line: None) -> BuildOptions:
    """A pre-quantized source decides the group size, keeps its embedding / classifier in their
    precision class (unless asked otherwise): INT4 when they arrived as codes the engine takes,
    int8 when they arrived quantized in another way (a GGUF's Q8_0, Q5_*, Q6_K: the fp16 default
    would double the bytes a decode step reads for the classifier), and rounds what is left
    with rtn, not awq (whose fold would rescale weights that are taken as they are)."""
    imported, quant = source.imported, options.quant
    if imported is None or quant.method != "int4":
        return options
    changes = {}
    for part, name in (("embedding", "embed"), ("lm_head", "lm_head")):
        if getattr(quant, part) is None and name in imported.loaders:
            changes[part] = "int4"
        elif getattr(quant, part) is None and name in imported.quantized:
            changes[part] = "int8"
            log(f"{part} int8: the source holds it quantized ({imported.notes.get(name, '?')}), not as float")
    if imported.loaders:
        changes["group_size"] = imported.group_size
        if quant.algorithm in ("awq", "awq_gptq"):
            changes["algorithm"] = "rtn"
        if quant.group_size != imported.group_size:
            log(f"group size {imported.group_size}: the source's own (not {quant.group_size})")
    return replace(options, quant=replace(quant, **changes)) if changes else options


def _needs_calibration(options: BuildOptions) -> bool:
    return options.quant.method == "int4" and (options.quant.algorithm != "rtn" or options.calibration is not None)


def calibration_sequences(source: SourceModel, options: BuildOptions) -> list:
    """Calibration text -> token windows of at most min(CALIBRATION_WINDOW, max positions) ids."""
    if options.calibration:
        try:
            text = Path(options.calibration).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BuildError(options.calibration, f"cannot read calibration text: {exc}") from None
    else:
        text = default_calibration_text()
    ids = _tokenizer(source).encode(text, add_special_tokens=False).ids
    window = min(CALIBRATION_WINDOW, source.config.max_position_embeddings)
    return split_sequences(ids, window)


def evaluate(source: SourceModel, encoded: dict, progress: bool) -> dict:
    """Perplexity of the float and the quantized model on the shipped eval text (numpy reference forward:
    minutes for a model of a few hundred million parameters). -> Evaluation.to_dict()"""
    tok = _tokenizer(source)
    window = min(CALIBRATION_WINDOW, source.config.max_position_embeddings)
    sequences = split_sequences(tok.encode(default_eval_text(), add_special_tokens=False).ids, window)
    prompt = sequences[0][:16]
    if source.tokenizer.add_bos and source.tokenizer.bos_token_id is not None:
        prompt = [source.tokenizer.bos_token_id] + prompt
    fp = dense_engine_tensors(source.config, source.tensors)
    return evaluate_model(source.config, fp, encoded, sequences, prompt, num_greedy=32, progress=progress).to_dict()


def _tokenizer(source: SourceModel):
    return Tokenizer.from_str(source.tokenizer.files["tokenizer.json"].decode("utf-8"))


def _describe(source: SourceModel, options: BuildOptions) -> str:
    c, q = source.config, options.quant.manifest()
    scheme = "unquantized" if q["method"] == "none" else f"INT4 g{q['group_size']} {q['algorithm']}"
    return (f"{c.architecture} ({c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}) "
            f"from {source.kind} {source.path}, {scheme}")


def format_report(report: dict, max_rows: int = 40) -> str:
    """The build's error report as text: one line per tensor, then the means and the perplexity."""
    tensors = report.get("tensors") or {}
    lines = [f"{'tensor':<28} {'encoding':<8} {'origin':<11} {'weight rel err':>14} {'output rel err':>14}  source"]
    for i, (name, t) in enumerate(tensors.items()):
        if i == max_rows:
            lines.append(f"... {len(tensors) - max_rows} more tensors (all in engine.json \"report\")")
            break
        lines.append(f"{name:<28} {t['encoding']:<8} {t.get('origin', '-'):<11} {_num(t['weight_rel_error']):>14} "
                     f"{_num(t['output_rel_error']):>14}  {t.get('source', '')}".rstrip())
    origins = [t.get("origin") for t in tensors.values()]
    if any(o in ("exact", "mapped", "requantized") for o in origins):
        lines.append(", ".join(f"{origins.count(o)} {o}" for o in ("exact", "mapped", "requantized", "quantized", "float")
                               if o in origins) + " (exact: the source's codes and scales, bit-exact; mapped: its "
                     "codes with scales rounded to float16; requantized: dequantized and quantized again)")
    lines.append(f"mean INT4 weight rel err {_num(report.get('mean_weight_rel_error'))}, "
                 f"output rel err {_num(report.get('mean_output_rel_error'))} "
                 f"({report.get('num_calibration_tokens', 0)} calibration tokens)")
    ev = report.get("evaluation")
    if ev:
        lines.append(f"perplexity on {ev['num_eval_tokens']} held-out tokens: float {ev['fp_perplexity']:.4f}, "
                     f"quantized {ev['quant_perplexity']:.4f} ({100 * ev['perplexity_change']:+.2f}%); "
                     f"top-1 agreement {ev['top1_agreement']:.3f}, greedy prefix {ev['greedy_prefix']}/{ev['num_greedy']}")
    return "\n".join(lines)


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"
