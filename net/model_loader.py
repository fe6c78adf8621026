"""Build what the server serves: an `EngineCore` and the routes' `ModelInfo`, from a model
spec and a backend name. Runs off the event loop (it may build the default model first).

Backends: "mock" (kernels/mock.py: a fixed story at a fixed step time), "cpu" (C
kernels when built, else the numpy reference), "reference" (numpy), "cuda". The executor
factory for the real backends lives in core/model_runner.py; engine directories come from
engine_build (`resolve_model` for a path or hub name, the embedded default when no model
is given).
"""

import json
import logging
import time
from collections import deque
from pathlib import Path

from .app import ModelInfo
from .chat_template import CHATML, ChatTemplate
from .prompt_encoder import piece_encoder

BACKENDS = ("cpu", "reference", "mock", "cuda")
log = logging.getLogger("tokenwire.net")


def load_model(spec: str | None, backend: str, *, step_times: deque, served_model_name: str | None = None,
               chat_template: str | None = None, max_model_len: int | None = None, max_num_seqs: int = 256,
               mock_step_us: float = 0.0, max_queued_requests: int = 1024):
    """-> (EngineCore not yet started, ModelInfo)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    template_source = _read_template(chat_template) if chat_template else None
    engine_kwargs = dict(max_num_seqs=max_num_seqs, max_queued_requests=max_queued_requests)
    if backend == "mock":
        return _load_mock(step_times, served_model_name, template_source, max_model_len, mock_step_us, engine_kwargs)
    return _load_engine(spec, backend, step_times, served_model_name, template_source, max_model_len, engine_kwargs)


def _read_template(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the chat template {path!r}: {exc.strerror}") from None
    if path.endswith(".json"):     # a tokenizer_config.json
        try:
            return json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path!r} has no \"chat_template\" string") from None
    return text


def _load_mock(step_times, name, template_source, max_model_len, step_us, engine_kwargs):
    from ..kernels.mock import BOS, EOS, build_mock_engine_core
    max_model_len = max_model_len or 4096
    engine = build_mock_engine_core(step_us, max_model_len=max_model_len, **engine_kwargs)
    _time_steps(engine, step_times)
    tokenizer = engine.executor.inner.tokenizer
    template = ChatTemplate(template_source or CHATML, {"bos_token": BOS, "eos_token": EOS})
    fast = piece_encoder(tokenizer)
    info = ModelInfo(name=name or "mock", tokenizer=tokenizer,
                     encode=fast.encode if fast is not None else
                     lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                     chat_template=template, max_model_len=max_model_len, created=int(time.time()),
                     description=f"mock engine: a fixed story, {step_us:g} us per step", supports_logprobs=False)
    return engine, info


def _load_engine(spec, backend, step_times, name, template_source, max_model_len, engine_kwargs):
    from ..kernels.engine_format import load_engine
    from ..engine_build.resolve import resolve_model
    engine_dir = load_engine(resolve_model(spec, log=lambda line: log.info("%s", line)))
    limit = engine_dir.config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {limit} positions")
    max_model_len = max_model_len or limit
    engine = _engine_core(engine_dir, backend, max_model_len, engine_kwargs)
    _time_steps(engine, step_times)
    source = template_source or engine_dir.chat_template
    template = ChatTemplate(source, _special_tokens(engine_dir)) if source else None
    info = ModelInfo(name=name or engine_dir.name, tokenizer=engine_dir.tokenizer, encode=prompt_encoder(engine_dir),
                     chat_template=template, max_model_len=max_model_len, created=int(time.time()),
                     description=engine_dir.description)
    return engine, info


def prompt_encoder(engine_dir):
    """engine_dir.encode_prompt, through prompt_encoder.PieceEncoder when the tokenizer allows:
    the engine's BOS rule in front of the fast ids, checked against encode_prompt once here."""
    fast = piece_encoder(engine_dir.tokenizer)
    if fast is None:
        return engine_dir.encode_prompt
    bos = [engine_dir.bos_token_id] if engine_dir.add_bos and engine_dir.bos_token_id is not None else []

    def encode(text: str) -> list:
        return bos + fast.encode(text)
    probe = "Hello, world: 12 tokens' worth of text\n"
    if encode(probe) != engine_dir.encode_prompt(probe):
        log.warning("fast prompt encoding disagrees with the engine's encode_prompt; not used")
        return engine_dir.encode_prompt
    return encode


def _engine_core(engine_dir, backend, max_model_len, engine_kwargs):
    """EngineCore over the backend's executor."""
    if backend == "cuda":
        return _cuda_engine_core(engine_dir, max_model_len, engine_kwargs)
    from ..kernels.model_runner import build_engine_core
    if backend == "cpu":                # the C forward, or the numpy one with a one-line warning
        from ..kernels.cpu import create_model
        return build_engine_core(engine_dir, max_model_len=max_model_len, model_factory=create_model,
                                 **engine_kwargs)
    return build_engine_core(engine_dir, max_model_len=max_model_len, **engine_kwargs)


def _cuda_engine_core(engine_dir, max_model_len, engine_kwargs):
    from ..core.engine_core import EngineCore
    try:
        from ..kernels.cuda.driver import CudaError
        from ..kernels.cuda.executor import CudaExecutor, CudaOptions
        executor = CudaExecutor(engine_dir.config, engine_dir.tensors,
                                CudaOptions(max_model_len=max_model_len, max_batch=engine_kwargs["max_num_seqs"]))
    except ImportError as exc:
        raise ValueError(f"the cuda backend is not available: {exc} (pip install cuda-python)") from None
    except CudaError as exc:
        raise ValueError(f"the cuda backend is not available: {exc}") from None
    return EngineCore(executor, engine_dir.tokenizer, eos_token_ids=engine_dir.eos_token_ids,
                      max_model_len=max_model_len, **engine_kwargs)


def _time_steps(engine, step_times: deque) -> None:
    """Route every executor step through TimedExecutor (before the engine thread starts)."""
    from .server import TimedExecutor
    engine.executor = TimedExecutor(engine.executor, step_times)


def _special_tokens(engine_dir) -> dict:
    """bos/eos (and the other *_token entries) as the chat template sees them."""
    tokens = {}
    config_file = Path(engine_dir.path) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        tokens = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, (str, dict))}
    tok = engine_dir.manifest.get("tokenizer", {})
    for key in ("bos_token", "eos_token"):
        if tok.get(key):
            tokens[key] = tok[key]
    return tokens
