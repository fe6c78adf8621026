"""`tokenwire.Server`: the network server (net/server.py) around an engine that
tokenwire/runtime.py builds from `EngineOptions`.

    server = tokenwire.Server(backend="mock", port=0).start()   # own thread, own event loop
    ... requests to server.url ...
    server.stop()

Keyword arguments that are `EngineOptions` fields (core/options.py: backend,
max_model_len, max_num_seqs, warm_up, ...) shape the engine; the rest go to net's Server
(host, port, TLS, limits, ...). The engine is built and warmed up (runtime.py:
`build_warm_engine`) before /health turns 200. `tokenwire serve` is this class run on the
main thread.
"""

from dataclasses import replace
from functools import partial

from .core.options import DEFAULTS, FIELDS, EngineOptions
from .net.server import Server as NetServer
from .engine_process import build_engine_process
from .runtime import build_warm_engine


class Server(NetServer):
    def __init__(self, model: str | None = None, *, options: EngineOptions = DEFAULTS, engine=None,
                 model_info=None, **kwargs):
        engine_fields = {name: kwargs.pop(name) for name in list(kwargs) if name in FIELDS}
        if engine is not None:          # a prebuilt engine: nothing to assemble
            if model is not None or engine_fields:
                raise ValueError("a prebuilt engine takes no model or engine options")
            super().__init__(engine=engine, model_info=model_info, **kwargs)
            return
        self.options = replace(options, **engine_fields, **({"model": model} if model is not None else {}))
        load = build_engine_process if self.options.engine_process else build_warm_engine
        super().__init__(partial(load, self.options), **kwargs)
