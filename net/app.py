"""Routes and the per-step dispatch: requests in, engine outputs out as frames.

The Protocol shell hands `on_events` complete requests, resets and closes. A generation
route parses and validates the body (openai_api.py), renders the chat template, tokenizes,
stamps the request's Timeline and submits it to `EngineCore`; the exchange is then kept
under its engine request id. The engine thread calls `on_step_threadsafe` once per step;
on the loop, `on_step` encodes every output of that step into its connection's session and
writes each touched connection once (one transport write per connection per step).

Routes:
    POST /v1/completions, POST /v1/chat/completions    OpenAI, SSE when stream=true
    POST /generate                                      native NDJSON, or binary with Accept: application/octet-stream
    GET  /v1/models, /health, /metrics
Authentication (optional Bearer key) covers /v1/* and /generate; /health and /metrics stay
open for load balancers and scrapers.
"""

import hmac
import itertools
import logging
import threading
import time
from bisect import bisect_left
from collections import deque
from typing import Callable, NamedTuple

import orjson

from tokenwire.core.errors import InvalidRequest, PromptTooLong, QueueFull
from tokenwire.core.outputs import FINISH_CANCELLED, FINISH_ERROR, Timeline

from . import encoders
from .chat_template import ChatTemplate
from .errors import ApiError
from .events import BodyTooLarge, ConnectionClosed, Request, StreamReset
from .metrics import Metrics
from .openai_api import GenerationRequest, parse_chat, parse_completions, parse_generate, parse_json

log = logging.getLogger("tokenwire.net")

JSON = b"application/json"


class ModelInfo(NamedTuple):
    """What the routes need to know about the served model."""
    name: str                               # the id in /v1/models and in every response
    tokenizer: object                       # tokenizers.Tokenizer
    encode: Callable[[str], list]           # completion prompt -> ids, with the model's BOS rule
    chat_template: ChatTemplate | None
    max_model_len: int
    created: int                            # unix seconds, for /v1/models
    description: str                        # shown in /v1/models ("owned_by" stays "tokenwire")
    supports_logprobs: bool = True          # False for the mock engine, which samples nothing


class Exchange:
    """One generation request in flight: where its bytes go and how they are encoded."""
    __slots__ = ("request_id", "proto", "stream_id", "route", "encoder", "streaming", "timeline",
                 "last_ns", "response_id", "created", "texts", "token_ids", "logprobs", "want_logprobs",
                 "send", "encode")

    def __init__(self, request_id, proto, stream_id, route, encoder, streaming, timeline, response_id,
                 created, want_logprobs):
        self.request_id = request_id
        self.proto = proto
        self.stream_id = stream_id
        self.route = route
        self.encoder = encoder              # None for whole (non-streamed) responses
        self.streaming = streaming
        self.timeline = timeline
        self.last_ns = 0                    # when the previous token was dispatched (0: none yet)
        self.response_id = response_id
        self.created = created
        self.texts = []                     # whole responses collect here
        self.token_ids = []
        self.logprobs = []
        self.want_logprobs = want_logprobs
        self.send = proto.session.send_data                     # bound once: called per token
        self.encode = encoder.token if encoder is not None else None


class App:
    """The HTTP application: one per server, shared by every connection."""

    def __init__(self, *, metrics: Metrics | None = None, api_key: str | None = None, trace=None):
        self.engine = None                  # EngineCore, set by `attach` once the model is loaded
        self.model: ModelInfo | None = None
        self.loop = None
        self.metrics = metrics or Metrics()
        self.api_key = api_key.encode() if api_key else None
        self.trace = trace                  # trace.TraceWriter or None
        self.connections = set()
        self.exchanges: dict[int, Exchange] = {}
        self.load_error: str | None = None  # why the model is not available, for 503 bodies
        self._ids = itertools.count(1)
        self._touched = []
        self._firsts = []
        self._token_text_cache: dict[int, str] = {}
        self._anchor_id = None
        self.step_times_ns = deque()        # filled by the engine thread (TimedExecutor), drained here
        self._step_taken = threading.Semaphore(0)    # released when the loop picks a step up
        self.detached = False
        self.shutting_down = False
        self.routes = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
            "/generate": {"POST": self._generate},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
        }

    def attach(self, engine, model: ModelInfo, loop) -> None:
        """Serve `engine` (an EngineCore, started by the caller) from now on."""
        self.loop = loop
        self.model = model
        self.engine = engine
        engine.on_step = self.on_step_threadsafe

    # --------------------------------------------------- connection events

    def connection_made(self, proto) -> None:
        self.connections.add(proto)
        if self.shutting_down:
            proto.begin_shutdown()

    def connection_lost(self, proto) -> None:
        self.connections.discard(proto)
        self._cancel_all(proto)

    def on_events(self, proto, events: list) -> None:
        for ev in events:
            kind = type(ev)
            if kind is Request:
                self._handle(proto, ev)
            elif kind is StreamReset:
                self._cancel(proto, ev.stream_id)
            elif kind is BodyTooLarge:
                self._respond_error(proto, ev.stream_id, ApiError(
                    413, f"request body is larger than the limit of {proto.limits.max_body_bytes} bytes",
                    code="body_too_large"))
            elif kind is ConnectionClosed:
                self._cancel_all(proto)

    def _handle(self, proto, req: Request) -> None:
        try:
            path = req.target.split("?", 1)[0]
            methods = self.routes.get(path)
            if methods is None:
                raise ApiError(404, f"no route for {path!r}", code="unknown_url")
            handler = methods.get(req.method)
            if handler is None:
                allowed = ", ".join(methods)
                raise ApiError(405, f"method {req.method} is not allowed on {path}; use {allowed}",
                               code="method_not_allowed", headers=[(b"allow", allowed.encode())])
            handler(proto, req)
        except ApiError as exc:
            self._respond_error(proto, req.stream_id, exc)
        except Exception as exc:  # a bug here must not take the connection down
            log.exception("internal error handling %s %s", req.method, req.target)
            self._respond_error(proto, req.stream_id, ApiError(
                500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"))

    def _respond_error(self, proto, stream_id: int, exc: ApiError) -> None:
        if exc.status >= 400 and exc.status not in (404, 405):
            self.metrics.count_request("rejected")
        proto.session.respond(stream_id, exc.status, [(b"content-type", JSON)] + exc.headers, exc.body())

    # ---------------------------------------------------------- info routes

    def _health(self, proto, req) -> None:
        if not self._ready():
            raise ApiError(503, self._not_ready_reason(), code="model_not_ready")
        proto.session.respond(req.stream_id, 200, [(b"content-type", JSON)], b'{"status":"ok"}')

    def _models(self, proto, req) -> None:
        self._authorize(req)
        m = self._require_model()
        body = orjson.dumps({"object": "list", "data": [{
            "id": m.name, "object": "model", "created": m.created, "owned_by": "tokenwire",
            "max_model_len": m.max_model_len, "description": m.description}]})
        proto.session.respond(req.stream_id, 200, [(b"content-type", JSON)], body)

    def _metrics(self, proto, req) -> None:
        self._drain_step_times()
        stats = self.engine.stats() if self.engine is not None else None
        proto.session.respond(req.stream_id, 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                              self.metrics.render(stats))

    # ----------------------------------------------------- generation routes

    def _completions(self, proto, req) -> None:
        self._submit(proto, req, parse_completions(self._json_body(req)), "cmpl-")

    def _chat(self, proto, req) -> None:
        self._submit(proto, req, parse_chat(self._json_body(req)), "chatcmpl-")

    def _generate(self, proto, req) -> None:
        self._submit(proto, req, parse_generate(self._json_body(req)), "gen-")

    def _json_body(self, req: Request) -> dict:
        self._authorize(req)
        content_type = req.headers.get("content-type")
        if content_type is not None and content_type.split(";", 1)[0].strip().lower() != "application/json":
            raise ApiError(415, f"content-type must be application/json, got {content_type!r}",
                           code="unsupported_media_type")
        self._require_model()
        return parse_json(req.body)

    def _submit(self, proto, req: Request, g: GenerationRequest, id_prefix: str) -> None:
        """Tokenize, stamp and hand the request to the engine; the stream opens with its first token."""
        model = self.model
        if g.model is not None and g.model != model.name:
            raise ApiError(404, f"the model {g.model!r} does not exist; this server serves {model.name!r}",
                           param="model", code="model_not_found")
        if g.params.logprobs is not None and not model.supports_logprobs:
            raise ApiError(400, f"the {model.name!r} engine does not compute logprobs",
                           param="logprobs", code="unsupported_parameter")
        prompt_ids = self._prompt_ids(g)
        timeline = Timeline(arrived_ns=req.arrived_ns, tokenized_ns=time.monotonic_ns())
        request_id = next(self._ids)
        try:
            self.engine.add_request(request_id, prompt_ids, g.params, timeline)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full", headers=[(b"retry-after", b"1")]) from None
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param="messages" if g.route == "chat" else "prompt",
                           code="context_length_exceeded") from None
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_prompt") from None
        self.metrics.tokenize.observe_ns(timeline.tokenized_ns - timeline.arrived_ns)
        created = int(time.time())
        response_id = f"{id_prefix}{request_id}"
        encoder = self._encoder(g, req, response_id, created) if g.stream else None
        self.exchanges[request_id] = Exchange(request_id, proto, req.stream_id, g.route, encoder, g.stream,
                                              timeline, response_id, created, g.params.logprobs is not None)
        proto.requests[req.stream_id] = request_id

    def _prompt_ids(self, g: GenerationRequest) -> list:
        model = self.model
        if g.route == "chat":
            if model.chat_template is None:
                raise ApiError(400, f"the model {model.name!r} has no chat template; use /v1/completions, "
                               "or start the server with --chat-template FILE", code="no_chat_template")
            text = model.chat_template.render(g.messages)
            return model.tokenizer.encode(text, add_special_tokens=False).ids
        if g.prompt_token_ids is not None:
            return g.prompt_token_ids
        if not g.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
        return model.encode(g.prompt)

    def _encoder(self, g: GenerationRequest, req: Request, response_id: str, created: int):
        if g.route == "generate":
            accept = req.headers.get("accept", "")
            return encoders.BinaryTokens() if "application/octet-stream" in accept else encoders.Ndjson()
        cls = encoders.ChatSse if g.route == "chat" else encoders.CompletionSse
        return cls(response_id, created, self.model.name, g.include_usage, self.token_text)

    def token_text(self, token_id: int) -> str:
        """A token's text as it continues a text (logprobs), e.g. " there", not the
        start-of-text form "there" a lone decode gives for SentencePiece pieces. Cached."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            tokenizer = self.model.tokenizer
            anchor = self._anchor_id
            if anchor is None:
                anchor = self._anchor_id = tokenizer.encode("a", add_special_tokens=False).ids[-1]
            base = tokenizer.decode([anchor], skip_special_tokens=False)
            both = tokenizer.decode([anchor, token_id], skip_special_tokens=False)
            text = both[len(base):] if both.startswith(base) else tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    # ------------------------------------------------------------ dispatch

    def on_step_threadsafe(self, outputs: list) -> None:
        """Engine thread, once per step: hand the step to the loop, then wait until the loop
        has picked it up.

        The wait releases the GIL at once, so the loop writes these tokens now instead of
        after the engine's next step (or the interpreter's 5 ms switch interval), and the
        engine never runs more than one step ahead of the wire: a slow loop makes batches
        bigger instead of letting steps pile up."""
        if self.detached:
            return
        self.loop.call_soon_threadsafe(self.on_step, outputs)
        taken = self._step_taken
        while not taken.acquire(timeout=0.1):
            if self.detached:
                return

    def detach(self) -> None:
        """The loop is stopping: never block the engine thread again."""
        self.detached = True
        self._step_taken.release()

    def on_step(self, outputs: list) -> None:
        """Loop side of the hand-off: release the engine thread, then write the step."""
        self._step_taken.release()
        self._dispatch_step(outputs)

    def _dispatch_step(self, outputs: list) -> None:
        """Write one engine step's outputs to every stream (hot path: once per step).

        Frames for all streams of a connection are gathered in its session and leave in
        one transport write per connection. The inter-token histogram is updated inline
        (one bisect per token, sums once per step).
        """
        now = time.monotonic_ns()
        exchanges = self.exchanges
        touched = self._touched
        itl = self.metrics.itl
        itl_counts, itl_bounds = itl.counts, itl.bounds_ns
        itl_sum = itl_n = num_tokens = 0
        for out in outputs:
            ex = exchanges.get(out.request_id)
            if ex is None:
                continue            # cancelled: the client is gone
            if out.token_ids:
                num_tokens += len(out.token_ids)
                if ex.streaming:
                    last = ex.last_ns
                    if last:
                        gap = now - last
                        itl_counts[bisect_left(itl_bounds, gap)] += 1
                        itl_sum += gap
                        itl_n += 1
                    else:
                        self._open_stream(ex)
                    ex.last_ns = now
                    ex.send(ex.stream_id, ex.encode(out))
                else:
                    self._collect(ex, out)
            if out.finish_reason is not None:
                self._finish(ex, out, now)
            proto = ex.proto
            if not proto.dirty:
                proto.dirty = True
                touched.append(proto)
        for proto in touched:
            proto.dirty = False
            proto.flush()
        touched.clear()
        itl.sum_ns += itl_sum
        itl.count += itl_n
        if num_tokens:
            wire_ns = time.monotonic_ns()
            self.metrics.engine_to_wire.observe_many_ns(wire_ns - outputs[0].step_done_ns, num_tokens)
            self.metrics.streamed_tokens += num_tokens
            if self._firsts:
                self._stamp_first_tokens(wire_ns)
        times = self.step_times_ns
        while times:
            self.metrics.step.observe_ns(times.popleft())

    def _open_stream(self, ex: Exchange) -> None:
        """Response HEADERS go out with the first token: one write, and TTFT is the first token's.
        The header tuple is the encoder's constant, so its HPACK block is built once per connection."""
        ex.proto.session.start_response(ex.stream_id, 200, ex.encoder.response_headers)
        self._firsts.append(ex)

    def _stamp_first_tokens(self, wire_ns: int) -> None:
        for ex in self._firsts:
            ex.timeline.first_token_emitted_ns = wire_ns
            self.metrics.ttft.observe_ns(wire_ns - ex.timeline.arrived_ns)
        self._firsts.clear()

    def _collect(self, ex: Exchange, out) -> None:
        ex.texts.append(out.text)
        ex.token_ids.extend(out.token_ids)
        if ex.want_logprobs and out.logprobs is not None:
            ex.logprobs.extend(out.logprobs)

    def _finish(self, ex: Exchange, out, now: int) -> None:
        del self.exchanges[ex.request_id]
        ex.proto.requests.pop(ex.stream_id, None)
        reason = out.finish_reason
        if reason == FINISH_CANCELLED:
            return
        timings = encoders.timings_us(ex.timeline, now)
        use = encoders.usage(out.num_prompt_tokens, out.num_output_tokens)
        trailers = [(b"server-timing", encoders.server_timing(timings))]
        error = out.error if reason == FINISH_ERROR else None
        if ex.streaming:
            if not ex.last_ns:
                self._open_stream(ex)
            session = ex.proto.session
            session.send_data(ex.stream_id, ex.encoder.finish(out, reason, use, timings, error))
            session.end_response(ex.stream_id, trailers)
        else:
            self._respond_whole(ex, reason, use, trailers, error)
        self._record_finish(ex, reason, now)

    def _respond_whole(self, ex: Exchange, reason: str, use: dict, trailers: list, error: str | None) -> None:
        session = ex.proto.session
        if error is not None:
            exc = ApiError(500, f"the engine failed this request: {error}", code="engine_error")
            session.respond(ex.stream_id, 500, [(b"content-type", JSON)], exc.body(), trailers)
            return
        text = "".join(ex.texts)
        model = self.model.name
        if ex.route == "chat":
            lps = encoders.chat_logprobs(ex.token_ids, ex.logprobs, self.token_text) if ex.want_logprobs else None
            body = encoders.chat_body(ex.response_id, ex.created, model, text, reason, use, lps)
        else:
            body = encoders.completion_body(ex.response_id, ex.created, model, text, reason, use,
                                            self._completion_logprobs(ex) if ex.want_logprobs else None)
        session.respond(ex.stream_id, 200, [(b"content-type", JSON), (b"x-request-id", ex.response_id.encode())],
                        body, trailers)

    def _completion_logprobs(self, ex: Exchange) -> dict:
        tokens = [self.token_text(t) for t in ex.token_ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
        return {"tokens": tokens, "token_logprobs": [lp.token_logprob for lp in ex.logprobs],
                "top_logprobs": [{self.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
                                 for lp in ex.logprobs],
                "text_offset": offsets}

    def _record_finish(self, ex: Exchange, reason: str, now: int) -> None:
        m = self.metrics
        t = ex.timeline
        m.count_request(reason if reason in m.requests else "error")
        m.e2e.observe_ns(now - t.arrived_ns)
        if t.first_scheduled_ns and t.queued_ns:
            m.queue.observe_ns(t.first_scheduled_ns - t.queued_ns)
        if self.trace is not None:
            self.trace.add(ex.request_id, ex.route, t, now)

    def _drain_step_times(self) -> None:
        times = self.step_times_ns
        step = self.metrics.step
        while times:
            step.observe_ns(times.popleft())

    # -------------------------------------------------------- cancellation

    def _cancel(self, proto, stream_id: int) -> None:
        request_id = proto.requests.pop(stream_id, None)
        if request_id is not None and self.exchanges.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            self.metrics.count_request("cancelled")

    def _cancel_all(self, proto) -> None:
        for stream_id in list(proto.requests):
            self._cancel(proto, stream_id)

    # -------------------------------------------------------------- guards

    def _ready(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    def _not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.engine is None:
            return "the model is still loading; retry shortly"
        return "the engine thread is not running"

    def _require_model(self) -> ModelInfo:
        if not self._ready():
            raise ApiError(503, self._not_ready_reason(), code="model_not_ready",
                           headers=[(b"retry-after", b"1")])
        return self.model

    def _authorize(self, req: Request) -> None:
        if self.api_key is None:
            return
        given = req.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])

    # ------------------------------------------------------------ shutdown

    def begin_shutdown(self) -> None:
        """GOAWAY / Connection: close on every connection; in-flight streams run to their end."""
        self.shutting_down = True
        for proto in list(self.connections):
            proto.begin_shutdown()

    def close_idle(self, idle_timeout_s: float) -> None:
        """Close connections with no stream for `idle_timeout_s` (called periodically)."""
        cutoff = time.monotonic() - idle_timeout_s
        for proto in list(self.connections):
            if proto.is_idle and proto.last_active < cutoff:
                proto.begin_shutdown()
