"""Every executor, and the one table that names them.

`BACKENDS[name]` is a `Backend`: `create_executor(model, options, max_model_len) ->
Executor` (core/executor.py), where `model` is a loaded engine directory
(kernels/engine_format.Engine), or whatever the row's `builtin_model(options)` returned for
a backend that brings its own model (the mock). tokenwire/runtime.py is the one place that
calls it, and builds the EngineCore around the executor.

Adding a backend: one module in kernels/ with its `create_executor`, plus one row here.

Shared pieces live beside the backends: the numpy reference forward (model.py) with its
forward batches, RoPE and sampling arithmetic, the model runner that drives a forward
object on the host (model_runner.py), and the engine-directory reader (engine_format.py).
"""

from typing import Callable, NamedTuple, Optional

from . import cpu, cuda, mock, model_runner, trt


class Backend(NamedTuple):
    create_executor: Callable               # (model, EngineOptions, max_model_len) -> Executor
    description: str                        # one line for `tokenwire serve --help`
    builtin_model: Optional[Callable] = None    # EngineOptions -> the model it brings; None: an engine directory
    samples_logprobs: bool = True           # the executor returns logprobs when a request asks
    samples_constrained: bool = True        # the executor masks rows with a SeqStep.constraint
    speculates: bool = True                 # the executor verifies SeqStep.num_spec proposed rows


BACKENDS = {
    "cpu": Backend(cpu.create_executor, "C kernels (AVX-512 / AVX2 / scalar; numpy when not built)"),
    "reference": Backend(model_runner.create_executor, "the numpy reference forward"),
    "mock": Backend(mock.create_executor, "a fixed story at --mock-step-us per step (benchmarks)",
                    builtin_model=mock.load_model, samples_logprobs=False, samples_constrained=False,
                    speculates=False),
    "cuda": Backend(cuda.create_executor, "NVIDIA GPU through cuda-python", samples_constrained=False),
    "trt": Backend(trt.create_executor, "TensorRT engines built from the model's ONNX export (NVIDIA GPU)",
                   samples_constrained=False, speculates=False),
}


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None
