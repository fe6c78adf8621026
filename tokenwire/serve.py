"""`tokenwire serve`: serve a model over HTTP/2 (h2c, TLS ALPN h2, h2c upgrade) and HTTP/1.1.

    tokenwire serve                                   # the embedded default model, port 8000
    tokenwire serve --model out/stories260K --port 8080
    tokenwire serve --backend mock --mock-step-us 200 # the benchmark engine
    curl --http2-prior-knowledge localhost:8000/v1/completions \\
         -H 'content-type: application/json' -d '{"prompt": "Once upon a time", "stream": true}'

SIGTERM or Ctrl-C: GOAWAY to every client, in-flight streams finish, exit 0.
"""

import logging
import re
import sys

from .core.options import ACTIVATIONS, DEFAULTS
from .core.sampling_params import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from .kernels import BACKENDS
from .net.budgets import ServerLimits, raise_fd_limit
from .net.protocol.events import BUSY_POLL_US, Limits
from .server import Server


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(text)
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """'512MiB', '1.5GB', '2g', '1048576' -> bytes (SI units are powers of 10, IEC ones of 2)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(text)
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(text)
    return value


def _prefill_cap(text: str) -> int:
    """--prefill-cap: auto -> -1, off -> 0, N -> N (EngineOptions.prefill_cap)."""
    if text in ("auto", "off"):
        return -1 if text == "auto" else 0
    return _positive_int(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_non_negative_int.__name__ = "non-negative integer"
_prefill_cap.__name__ = "auto, off or a positive integer"
_positive_int.__name__ = "positive integer"     # argparse names the type in its error message
_positive_float.__name__ = "positive number"
_port.__name__ = "port (0-65535)"
_non_negative_float.__name__ = "non-negative number"
byte_size.__name__ = "size (bytes, or with a unit: 512MiB, 2GB, 1g)"


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else byte_size(text)


_size_or_zero.__name__ = "size (bytes, or with a unit: 128KiB), or 0"


def add_arguments(parser) -> None:
    d = Limits()
    parser.add_argument("--model", default=DEFAULTS.model, metavar="PATH|org/name",
                        help="engine directory, Hugging Face model directory or hub name "
                             "(default: the embedded default model, built on first use)")
    parser.add_argument("--backend", default=DEFAULTS.backend, choices=tuple(BACKENDS),
                        help="; ".join(f"{name}: {row.description}" for name, row in BACKENDS.items())
                             + " (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="port to bind, 0 for any (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id in /v1/models and responses (default: the model's name)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template (or a tokenizer_config.json) overriding the model's")
    parser.add_argument("--max-model-len", type=_positive_int, default=DEFAULTS.max_model_len,
                        help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULTS.max_num_seqs,
                        help="largest running batch (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=DEFAULTS.max_num_batched_tokens,
                        help="tokens per engine step: prefill chunks plus one per decoding request "
                             "(default: %(default)s)")
    parser.add_argument("--prefill-cap", type=_prefill_cap, default=DEFAULTS.prefill_cap, metavar="auto|off|N",
                        help="prompt tokens a step that carries decodes may take: auto, measured so that such "
                             "a step stays within a quarter of a decode step of one (but never below a quarter "
                             "of the prompt tokens pending, at most 16: a prompt always moves); off; or at "
                             "most N (default: auto)")
    parser.add_argument("--max-queued-requests", type=_positive_int, default=DEFAULTS.max_queued_requests,
                        help="requests waiting for the engine before 429 (default: %(default)s)")
    parser.add_argument("--kv-cache-memory", type=byte_size, default=DEFAULTS.kv_cache_bytes, metavar="SIZE",
                        help="memory for the KV cache, e.g. 256MiB or 2GB (default: the backend's, 1 GiB "
                             "on the CPU); the number of KV blocks follows from it")
    parser.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                        default=DEFAULTS.enable_prefix_caching,
                        help="recompute every prompt: no reuse of the KV blocks of a prefix seen before")
    parser.add_argument("--response-cache-size", type=_non_negative_int, default=DEFAULTS.response_cache_size,
                        metavar="N", help="answer a repeated greedy or seeded request (same prompt and parameters) "
                                          "from an LRU of the last N answers without running the model "
                                          "(default: %(default)s, off)")
    parser.add_argument("--activations", default=DEFAULTS.activations, choices=ACTIVATIONS,
                        help="cpu backend: INT4 products on int8-quantized activations (llama.cpp's trade-off; "
                             "perplexity +0.01-0.02%%) or exact fp32 ones, which match the numpy reference "
                             "(default: %(default)s)")
    parser.add_argument("--speculative", default=DEFAULTS.speculative, choices=SPECULATIVE_METHODS,
                        help="speculative decoding (cpu, reference and cuda backends): 'ngram' proposes what followed "
                             "the last few tokens where they occurred before (prompt lookup), 'draft' what "
                             "--speculative-model predicts; one step verifies the proposals, and greedy and "
                             "sampled outputs are the model's own. A request may choose with its "
                             "'speculative' field (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=_positive_int, default=DEFAULTS.num_speculative_tokens,
                        metavar="K", help=f"tokens proposed per step, at most (1-{MAX_SPECULATIVE_TOKENS}; it "
                                          "shrinks, and pauses, for a request whose proposals are rejected) "
                                          "(default: %(default)s)")
    parser.add_argument("--speculative-model", default=DEFAULTS.speculative_model, metavar="PATH",
                        help="the draft model for --speculative draft: a smaller model with the same tokenizer "
                             "(an engine directory, a checkpoint or a GGUF, as --model), with its own KV blocks")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=DEFAULTS.warm_up,
                        help="answer /health 200 as soon as the model is loaded, without first running a "
                             "prefill, a decode and constrained sampling through the engine (the first "
                             "requests then pay the engine's cold start: page faults, lazy setup)")
    parser.add_argument("--mock-step-us", type=_non_negative_float, default=DEFAULTS.mock_step_us,
                        help="mock backend: microseconds per engine step (default: %(default)s, zero cost)")
    parser.add_argument("--inline-step-us", type=_non_negative_float, default=DEFAULTS.inline_step_us, metavar="US",
                        help="run engine steps whose executor time is at most this on the event loop instead of "
                             "the engine thread, where the thread hand-off would cost more than the step "
                             "(default: %(default)s; 0: always the engine thread)")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false", default=DEFAULTS.overlap,
                        help="process each engine step's outputs before launching the next, instead of while "
                             "it runs (overlap is on where the backend's step releases the GIL: cuda, mock; "
                             "the cpu backend's step never overlaps)")
    parser.add_argument("--engine-process", action="store_true", default=DEFAULTS.engine_process,
                        help="run the engine (scheduler, executor, detokenizer) in a process of its own, so the "
                             "event loop and the engine each have a GIL: more tokens per second where the "
                             "host's work outgrows one core (many streams, a short step); a socket hop per step")
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate chain (enables HTTPS, ALPN h2)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="TLS private key")
    parser.add_argument("--http2-only", action="store_true", default=d.http2_only,
                        help="speak HTTP/2 alone: cleartext bytes that are not the HTTP/2 preface get GOAWAY "
                             "PROTOCOL_ERROR instead of HTTP/1.1 (h2spec 146/146), TLS offers ALPN h2 alone "
                             "(default: HTTP/2 and HTTP/1.1 on one port)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                             "(gRPC: the authorization metadata)")
    parser.add_argument("--strict-params", action="store_true",
                        help="reject request fields this server does not know with a 400 (default: ignore "
                             "them, logging each field name once)")
    parser.add_argument("--no-access-log", dest="access_log", action="store_false",
                        help="do not log one line per request (the periodic engine line stays)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=d.max_body_bytes,
                        help="largest request body, else 413 (default: %(default)s)")
    parser.add_argument("--max-concurrent-streams", type=_positive_int, default=d.max_concurrent_streams,
                        help="HTTP/2 streams per connection (default: %(default)s)")
    parser.add_argument("--max-header-list-size", type=_positive_int, default=d.max_header_list_size,
                        help="largest request header block in bytes (default: %(default)s)")
    parser.add_argument("--idle-timeout", type=_non_negative_float, default=d.idle_timeout_s, metavar="SECONDS",
                        help="close connections idle this long (default: %(default)s)")
    parser.add_argument("--handshake-timeout", type=_positive_float, default=d.handshake_timeout_s, metavar="SECONDS",
                        help="connect to first complete request (HTTP/2 preface included), else closed; "
                             "trickled bytes do not extend it (default: %(default)s)")
    parser.add_argument("--write-timeout", type=_positive_float, default=d.write_timeout_s, metavar="SECONDS",
                        help="output that makes no progress this long: the stream is reset and its request "
                             "cancelled, or a connection that reads nothing is closed (default: %(default)s)")
    parser.add_argument("--max-unsent-bytes", type=_positive_int, default=d.max_unsent_bytes,
                        help="response bytes a connection may leave unread (windows + socket) before it "
                             "is closed, GOAWAY ENHANCE_YOUR_CALM (default: %(default)s)")
    parser.add_argument("--socket-send-buffer", type=_size_or_zero, default=d.socket_send_buffer, metavar="SIZE",
                        help="each connection's kernel send buffer (SO_SNDBUF); 0: the OS's autotuning "
                             "(default: %(default)s)")
    parser.add_argument("--max-resets-per-s", type=_positive_float, default=d.max_resets_per_s, metavar="N",
                        help="HTTP/2 streams a client may reset before their response starts (or make us "
                             "reset), per second: the rapid-reset budget (default: %(default)s)")
    parser.add_argument("--max-settings-per-s", type=_positive_float, default=d.max_settings_per_s, metavar="N",
                        help="HTTP/2 SETTINGS frames per second (default: %(default)s)")
    parser.add_argument("--max-pings-per-s", type=_positive_float, default=d.max_pings_per_s, metavar="N",
                        help="HTTP/2 PING frames per second (default: %(default)s)")
    parser.add_argument("--max-window-updates-per-s", type=_positive_float, default=d.max_window_updates_per_s,
                        metavar="N", help="HTTP/2 WINDOW_UPDATE frames per second (default: %(default)s)")
    parser.add_argument("--max-empty-frames-per-s", type=_positive_float, default=d.max_empty_frames_per_s,
                        metavar="N", help="HTTP/2 frames that do nothing (empty DATA/HEADERS/CONTINUATION, "
                                          "PRIORITY, unknown types) per second (default: %(default)s)")
    parser.add_argument("--max-queued-control-frames", type=_positive_int, default=d.max_queued_control_frames,
                        help="HTTP/2 control frames (ACKs, RST_STREAM) owed to a client that does not read "
                             "(default: %(default)s)")
    parser.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                        help="open connections, server-wide; more are refused at accept (HTTP/1.1 503, HTTP/2 "
                             "GOAWAY) (default: the open-file limit, raised to its hard limit at start, less 256, "
                             "and at most 1/32 of memory at 32 KiB per connection)")
    parser.add_argument("--max-total-unsent-bytes", type=byte_size, default=None, metavar="SIZE",
                        help="response bytes all connections together may leave unread; over it the connections "
                             "holding the most are closed, the oldest stall first (default: 1/64 of memory, "
                             "within 16 MiB-1 GiB)")
    parser.add_argument("--max-total-body-bytes", type=byte_size, default=None, metavar="SIZE",
                        help="request-body bytes buffered for incomplete requests, all connections; over it the "
                             "connections holding the most are closed (default: 1/64 of memory, within 16 MiB-1 GiB)")
    parser.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"),
                        help="event loop (default: %(default)s)")
    parser.add_argument("--busy-poll-us", type=_non_negative_float, default=BUSY_POLL_US, metavar="US",
                        help="after the last request in flight ends, poll sockets without sleeping this long "
                             "(lower TTFT for the next request, at most this much CPU per burst; 0: off; "
                             "default: %(default)s)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write per-request stage timelines as Chrome/Perfetto trace JSON")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="least severe log messages shown (default: %(default)s)")


def _server_limits(args) -> ServerLimits:
    """The flags given over the machine's defaults (net/budgets.py), read after the open-file
    limit is raised: the connection limit's default follows it."""
    before, after = raise_fd_limit()
    if after != before:
        logging.getLogger("tokenwire").info("open-file limit raised from %d to %d", before, after)
    given = {"max_connections": args.max_connections, "max_total_unsent_bytes": args.max_total_unsent_bytes,
             "max_total_body_bytes": args.max_total_body_bytes}
    return ServerLimits(**{name: value for name, value in given.items() if value is not None})


def run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        limits = Limits(http2_only=args.http2_only,
                        max_body_bytes=args.max_body_bytes, max_concurrent_streams=args.max_concurrent_streams,
                        max_header_list_size=args.max_header_list_size, idle_timeout_s=args.idle_timeout,
                        handshake_timeout_s=args.handshake_timeout, write_timeout_s=args.write_timeout,
                        max_unsent_bytes=args.max_unsent_bytes, socket_send_buffer=args.socket_send_buffer,
                        max_resets_per_s=args.max_resets_per_s,
                        max_settings_per_s=args.max_settings_per_s, max_pings_per_s=args.max_pings_per_s,
                        max_window_updates_per_s=args.max_window_updates_per_s,
                        max_empty_frames_per_s=args.max_empty_frames_per_s,
                        max_queued_control_frames=args.max_queued_control_frames)
        server_limits = _server_limits(args)
        server = Server(args.model, backend=args.backend, served_model_name=args.served_model_name,
                        chat_template=args.chat_template, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_cap=args.prefill_cap,
                        max_queued_requests=args.max_queued_requests, mock_step_us=args.mock_step_us,
                        kv_cache_bytes=args.kv_cache_memory, strict_params=args.strict_params,
                        access_log=args.access_log,
                        enable_prefix_caching=args.enable_prefix_caching,
                        response_cache_size=args.response_cache_size, inline_step_us=args.inline_step_us,
                        overlap=args.overlap, engine_process=args.engine_process,
                        activations=args.activations, warm_up=args.warm_up, speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens,
                        speculative_model=args.speculative_model,
                        host=args.host, port=args.port, loop=args.loop, tls_cert=args.tls_cert, tls_key=args.tls_key,
                        api_key=args.api_key, limits=limits, trace=args.trace, freeze_gc=True,
                        busy_poll_us=args.busy_poll_us, server_limits=server_limits)
        return server.run()
    except (ValueError, OSError, ImportError) as exc:
        print(f"tokenwire serve: {exc}", file=sys.stderr)
        return 2
