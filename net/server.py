"""`tokenwire.Server`: the whole server (listening sockets, app, engine) in one object.

In-process use (tests, notebooks, benchmarks):

    server = tokenwire.Server(backend="mock", port=0).start()   # own thread, own event loop
    ... requests to server.url ...
    server.stop()

`tokenwire serve` calls `Server.run()` instead, which serves on the calling thread until
SIGTERM or SIGINT, then shuts down gracefully and returns 0: the listening sockets close
(new connections are refused), new HTTP/2 streams are refused with REFUSED_STREAM,
in-flight streams run to their end (at most 30 s), each HTTP/2 connection then gets its
GOAWAY (HTTP/1.1: `Connection: close`), and the engine stops. The log says what it waits
for; a second SIGINT (Ctrl-C) or SIGTERM exits at once (status 130).

The server listens before the model is loaded; until it is, /health and the generation
routes answer 503. `start()` waits for the model unless `wait_ready=False`.
"""

import asyncio
import gc
import logging
import os
import signal
import ssl
import threading
import time
from typing import Callable

from .api.model_info import model_info
from .app import App
from .budgets import ServerLimits
from .memory import GiveBack
from .metrics import Metrics
from .protocol.events import BUSY_POLL_US, Limits
from .protocol.shell import ServerProtocol
from .trace import TraceWriter

log = logging.getLogger("tokenwire.net")

LOOPS = ("uvloop", "asyncio")
DRAIN_TIMEOUT_S = 30.0      # SIGTERM: in-flight streams get this long to finish (deploy/k8s's grace period covers it)
ENGINE_LOG_INTERVAL_S = 10.0        # the periodic throughput / running / waiting / KV line, while busy


def tls_context(cert_file: str, key_file: str, http2_only: bool) -> ssl.SSLContext:
    """TLS 1.2+ with ALPN offering h2 then http/1.1 (h2 alone for `Limits.http2_only`)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert_file!r} / key {key_file!r}: {exc}") from None
    ctx.set_alpn_protocols(["h2"] if http2_only else ["h2", "http/1.1"])
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


class Server:
    """tokenwire's HTTP/2 + HTTP/1.1 server around one engine.

    load: called once, off the event loop, after the server listens: -> (EngineCore not yet
        started, core.model_card.ModelCard). tokenwire/runtime.py's `build_engine` is the
        one that serves models (`tokenwire.Server` passes it); until it returns, /health
        and the generation routes answer 503.
    engine, model_info: serve an already built `EngineCore` and its `model_info.ModelInfo`
        instead (the server starts and stops the engine).
    freeze_gc: `gc.freeze()` once the model is loaded, so full collections skip everything
        loaded at startup (tail latency); process-wide, hence off for in-process use and on
        for `tokenwire serve`.
    busy_poll_us: after the last request in flight ends, poll the sockets without blocking
        this long before the loop sleeps (dispatch.py: a request in that window skips the
        idle core's wake-up); 0: never.
    limits, server_limits: per connection (events.Limits) and server-wide (budgets.ServerLimits,
        whose defaults are read from the machine); the periodic sweep also gives memory back
        after a burst (memory.py).
    """

    def __init__(self, load: Callable[[], tuple] | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                 loop: str = "uvloop", tls_cert: str | None = None, tls_key: str | None = None,
                 api_key: str | None = None, limits: Limits | None = None, trace: str | None = None,
                 engine=None, model_info=None, reuse_port: bool = False, freeze_gc: bool = False,
                 busy_poll_us: float = BUSY_POLL_US, access_log: bool = True, strict_params: bool = False,
                 engine_log_interval_s: float = ENGINE_LOG_INTERVAL_S, server_limits: ServerLimits | None = None):
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if (engine is None) != (model_info is None):
            raise ValueError("pass engine and model_info together")
        if (load is None) == (engine is None):
            raise ValueError("pass either load or engine and model_info")
        if not busy_poll_us >= 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        self._load_engine = load
        self.host = host
        self.port = port
        self.loop_kind = loop
        self.limits = limits or Limits()
        self.ssl = tls_context(tls_cert, tls_key, self.limits.http2_only) if tls_cert else None
        self._cert_file = tls_cert
        self._prebuilt = (engine, model_info) if engine is not None else None
        self.reuse_port = reuse_port
        self.freeze_gc = freeze_gc
        self.app = App(metrics=Metrics(), api_key=api_key, trace=TraceWriter(trace) if trace else None,
                       access_log=access_log, strict_params=strict_params, server_limits=server_limits)
        self.give_back = GiveBack()
        self.api_key = api_key
        self.engine_log_interval_s = engine_log_interval_s
        self.app.dispatcher.busy_poll.window_ns = int(busy_poll_us * 1000)
        self.engine = None
        self.loop = None
        self._servers = []
        self._thread = None
        self._listening = threading.Event()
        self._ready = threading.Event()
        self._stop = None               # asyncio.Event, made on the server's loop
        self._startup_error: BaseException | None = None
        self._done = threading.Event()

    # ------------------------------------------------------------ in-process

    def start(self, timeout: float = 300.0, wait_ready: bool = True) -> "Server":
        """Serve on a background thread; returns once listening (and, by default, the model is ready)."""
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        self._thread = threading.Thread(target=self._thread_main, name="tokenwire-loop", daemon=True)
        self._thread.start()
        event = self._ready if wait_ready else self._listening
        if not event.wait(timeout) and self._startup_error is None:
            raise TimeoutError(f"the server did not become ready within {timeout} s")
        if self._startup_error is not None:
            raise RuntimeError(f"the server failed to start: {self._startup_error}") from self._startup_error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop: drain in-flight streams (at most `timeout` s), stop the engine, join the thread."""
        if self._thread is None:
            return
        if self.loop is not None and not self._done.is_set():
            try:
                self.loop.call_soon_threadsafe(self._request_stop, timeout)
            except RuntimeError:        # the loop ended and closed since the check (a failed start): nothing to stop
                pass
        self._thread.join(timeout + 10)
        self._thread = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def _thread_main(self) -> None:
        loop = new_event_loop(self.loop_kind)
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.serve())
        except BaseException as exc:
            self._startup_error = self._startup_error or exc
            self._listening.set()
            self._ready.set()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._done.set()

    # ------------------------------------------------------------------ CLI

    def run(self) -> int:
        """Serve on this thread until SIGTERM/SIGINT, shut down gracefully, return the exit code."""
        loop = new_event_loop(self.loop_kind)
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.serve(install_signals=True))
        finally:
            loop.close()
        return 1 if self._startup_error is not None else 0     # the error is logged where it happened

    # ------------------------------------------------------------ lifecycle

    async def serve(self, install_signals: bool = False) -> None:
        """Listen, load the model, serve until stopped, then drain."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._stop = asyncio.Event()
        self._drain_timeout = DRAIN_TIMEOUT_S
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        await self._listen(loop)
        self._listening.set()
        sweeper = loop.call_later(self._sweep_interval(), self._sweep)
        self._engine_log_timer = loop.call_later(self.engine_log_interval_s, self._log_engine)
        try:
            if await self._load(loop):
                self._ready.set()
                await self._stop.wait()
            await self._drain(self._drain_timeout)
        finally:
            sweeper.cancel()
            self._engine_log_timer.cancel()
            self._close_everything()
            self._ready.set()

    async def _listen(self, loop) -> None:
        limits = self.limits
        app = self.app
        server = await loop.create_server(lambda: ServerProtocol(app, limits), self.host, self.port,
                                          ssl=self.ssl, backlog=1024, reuse_port=self.reuse_port or None)
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        log.info("tokenwire listening on %s (HTTP/2 %s%s)", self.url, "ALPN h2" if self.ssl else "h2c",
                 " only" if limits.http2_only else " + HTTP/1.1")

    async def _load(self, loop) -> bool:
        """Build the engine off the loop (the server already answers 503 meanwhile)."""
        try:
            if self._prebuilt is not None:
                engine, info = self._prebuilt
            else:
                engine, card = await loop.run_in_executor(None, self._load_engine)
                info = model_info(card)
        except Exception as exc:
            self.app.load_error = str(exc)
            self._startup_error = exc
            log.error("the model failed to load: %s", exc)
            return False
        self.engine = engine
        self.app.attach(engine, info, loop)
        if self.freeze_gc:
            # everything alive now (modules, the model, the tokenizer) lives as long as the process:
            # out of the collector's sight, a full collection no longer walks it (p99 TTFT)
            gc.freeze()
        engine.start()
        self.app.grpc.notify_watchers()         # gRPC health watchers: SERVING now
        log.info("serving %s (%s)", info.name, info.description)
        tls = f" --cacert {self._cert_file}" if self.ssl else ""
        auth = f" -H 'authorization: Bearer {self.api_key}'" if self.api_key else ""
        log.info("try: curl%s --http2%s %s/v1/completions -H 'content-type: application/json'%s "
                 "-d '{\"prompt\": \"Once upon a time\", \"max_tokens\": 32, \"stream\": true}'",
                 tls, "" if self.ssl else "-prior-knowledge", self.url, auth)
        return True

    def _on_signal(self, sig) -> None:
        """The first SIGINT/SIGTERM drains; a second one exits at once."""
        if self._stop.is_set():
            log.warning("%s again: exiting now, without waiting for %d streams in flight",
                        signal.Signals(sig).name, len(self.app.exchanges))
            logging.shutdown()
            os._exit(130)
        log.info("%s: shutting down (again to exit at once)", signal.Signals(sig).name)
        self._request_stop(self._drain_timeout)

    def _request_stop(self, timeout: float) -> None:
        self._drain_timeout = timeout
        if self._stop is not None:
            self._stop.set()

    async def _drain(self, timeout: float) -> None:
        """Refuse new work, let in-flight streams finish (bounded by `timeout`)."""
        for server in self._servers:
            server.close()
        num_streams, num_connections = len(self.app.exchanges), len(self.app.connections)
        if num_streams or num_connections:
            log.info("shutting down: waiting for %d requests in flight and %d open connections (at most %g s)",
                     num_streams, num_connections, timeout)
        self.app.begin_shutdown()
        start = time.monotonic()
        deadline = start + timeout
        while (self.app.exchanges or self.app.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self.app.exchanges or self.app.connections:
            log.warning("shutdown: gave up after %g s on %d requests and %d connections", timeout,
                        len(self.app.exchanges), len(self.app.connections))
        elif num_streams or num_connections:
            log.info("shutdown: the requests and connections ended in %.2f s", time.monotonic() - start)
        for proto in list(self.app.connections):
            proto.close()

    def _close_everything(self) -> None:
        for server in self._servers:
            server.close()
        self.app.detach()               # the engine thread must not wait for this loop any more
        if self.engine is not None:
            self.engine.shutdown(timeout=10)
            if not self.engine.is_alive():
                self.app.close()
        if self.app.trace is not None:
            self.app.trace.close()

    def _sweep_interval(self) -> float:
        limits = self.limits
        shortest = min(limits.idle_timeout_s, limits.handshake_timeout_s, limits.write_timeout_s)
        return max(0.05, min(shortest / 4, 5.0))

    def _log_engine(self) -> None:
        if self.engine is not None:
            self.app.engine_log.tick(self.engine.stats(), time.monotonic())
        if not self._stop.is_set():
            self._engine_log_timer = self.loop.call_later(self.engine_log_interval_s, self._log_engine)

    def _sweep(self) -> None:
        self.app.sweep()
        self.app.grpc.notify_watchers()
        if self.give_back.maybe(self.app.budget, time.monotonic()):
            self.app.metrics.count_given_back()
        if not self._stop.is_set():
            self.loop.call_later(self._sweep_interval(), self._sweep)


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
