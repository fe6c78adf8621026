"""Routes: complete requests in, responses or engine submissions out.

The Protocol shell hands `on_events` complete requests, resets and closes, and gRPC calls as
they arrive (headers, each message, the half-close: net/api/grpc.py). Every generation route
is a row of `api.ROUTES` (net/api/: one module per API family) and takes one intake path,
`_generation`: auth, content type, JSON, the family's parse into a `GenerationRequest`,
the chat template, tokenizing, the request's Timeline, `EngineCore`; from then on the
exchange belongs to the dispatcher (dispatch.py), which writes the engine's outputs as
they come, encoded and shaped by the request's row. Errors on a path take its family's
shape (`api.ERROR_BODIES`).

Routes:
    POST /v1/completions, POST /v1/chat/completions    OpenAI, SSE when stream=true
    POST /v1/responses                                  OpenAI Responses, its events when stream=true
    POST /v1/messages, /v1/messages/count_tokens        Anthropic Messages, its events when stream=true
    POST /generate                                      native NDJSON, or binary with Accept: application/octet-stream
    POST /tokenize, /detokenize                         vLLM's
    GET  /v1/models, /v1/models/{id}, /health, /metrics   and HEAD: the GET's headers and content-length
    gRPC (content-type application/grpc): tokenwire.v1.Generator, grpc.health.v1.Health,
         server reflection (net/api/grpc.py)
Any other method is 405 with `Allow`. Authentication (optional key, as `Authorization:
Bearer` or `x-api-key`) covers /v1/*, /generate, /tokenize, /detokenize and
tokenwire.v1.Generator; /health, /metrics and the gRPC health service stay open for load
balancers and scrapers.
A generation request's `priority` header (RFC 9218: `u=0` most urgent .. `u=7`, default 3)
is its scheduler priority, and HTTP/2 PRIORITY_UPDATE frames change it while it waits or
runs (net/api/priority.py); one that came before the request is already in its `priority`
header (http2.py rule 10). A generation request may carry `x-request-timeout-ms: N` (gRPC:
grpc-timeout): N ms after it arrived it is cancelled and ends with finish_reason "deadline"
(504 when nothing was sent).

Every response carries `x-request-id`: a generation's response id (the body's "id",
`cmpl-N`, ...; dispatch.py), else `req-N` from a counter of its own, so the ids of
generations stay consecutive. The access line ends with it.

A response that fails while it is being written resets its stream (HTTP/1.1: closes after
it), logged; it never takes the connection, or another stream, down. A prompt is bounded
by its byte length before it is tokenized, and a large one is tokenized on a worker thread
(prompt_limits.py); the request is submitted when its ids are ready, unless its stream was
reset meanwhile.
"""

import hmac
import itertools
import logging
import time
from dataclasses import replace
from functools import partial
from typing import NamedTuple
from urllib.parse import unquote

import orjson
from h2.errors import ErrorCodes

from ..core.constraint import InvalidConstraint
from ..core.errors import InvalidRequest, PromptTooLong, QueueFull
from ..core.outputs import Timeline
from ..core.sampling_params import choice_params
from .access_log import AccessLog, EngineLog
from .api import ERROR_BODIES, ROUTES, anthropic, tokenize
from .api.errors import ApiError, bad_param
from .api.fields import max_tokens_problem, parse_json
from .api.grpc import GRPC, STATUS_CODES, UNKNOWN, GrpcRoutes
from .api.model_info import ModelInfo
from .api.priority import urgency
from .api.prompt_limits import LARGE_PROMPT_CHARS, Tokenizing, max_token_bytes, min_prompt_tokens
from .api.route import GenerationRequest, Route
from .budgets import ServerBudget, ServerLimits
from .metrics import Metrics
from .protocol.events import (
    BodyTooLarge,
    ConnectionClosed,
    MessageRequest,
    PriorityUpdate,
    Request,
    RequestEnd,
    RequestMessage,
    StreamReset,
)
from .writer.choices import ChoiceGroup
from .writer.dispatch import JSON, Dispatcher, Exchange
from .writer.handoff import StepHandoff

log = logging.getLogger("tokenwire.net")
SWEEP_BATCH = 32            # connections whose deadlines one pass of the loop checks (ending one costs ~0.2 ms)


class Submission(NamedTuple):
    """A generation request between its route and the engine (tokenized on the loop, or on
    the worker thread for a large prompt)."""
    proto: object                       # protocol.ServerProtocol
    req: Request
    g: GenerationRequest
    request_id: int
    priority: int                       # RFC 9218 urgency (priority.py)
    deadline_ns: int | None             # monotonic; None: no deadline


class App:
    """The HTTP application: one per server, shared by every connection."""

    def __init__(self, *, metrics: Metrics | None = None, api_key: str | None = None, trace=None,
                 access_log: bool = True, strict_params: bool = False, server_limits: ServerLimits | None = None):
        self.engine = None                  # EngineCore, set by `attach` once the model is loaded
        self.model: ModelInfo | None = None
        self.metrics = metrics or Metrics()
        self.api_key = api_key.encode() if api_key else None
        self.trace = trace                  # trace.TraceWriter or None
        self.access_log = AccessLog(access_log)
        self.engine_log = EngineLog()       # the periodic throughput line (the server ticks it)
        self.dispatcher = Dispatcher(self.metrics, trace, self.access_log)
        # unknown request fields: ignored with one log line per route and name, or a 400 (--strict-params)
        self._unknown_params_logged = set()
        self.grpc = GrpcRoutes(self)
        self.exchanges = self.dispatcher.exchanges          # engine request id -> Exchange
        self.handoff = None                 # handoff.StepHandoff, made by `attach`
        self.connections = set()
        self.budget = ServerBudget(server_limits or ServerLimits(), self.connections)     # budgets.py
        self.load_error: str | None = None  # why the model is not available, for 503 bodies
        self._ids = itertools.count(1)
        self._response_ids = itertools.count(1)     # req-N: x-request-id of every response but a generation's
        self._token_job_ids = itertools.count(-1, -1)   # /tokenize work off the loop: never an engine request's id
        self.shutting_down = False
        self.loop = None
        self.tokenizing: Tokenizing | None = None   # the worker threads for large prompts, made by `attach`
        self._max_token_bytes: int | None = None    # prompt bytes one token covers at most (None: no bound)
        self._bos_ids: list = []                    # what `model.encode` puts before the text's ids
        self.routes = {path: {"POST": partial(self._generation, route, path)} for path, route in ROUTES.items()}
        self.routes |= {
            "/v1/messages/count_tokens": {"POST": self._count_tokens},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/v1/models": {"GET": self._models},
            "/v1/models/": {"GET": self._model},        # prefix: /v1/models/{id}
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
        }
        self.on_unknown_param = None if strict_params else {
            path: partial(self._ignore_unknown_param, path) for path, methods in self.routes.items() if "POST" in methods}

    def attach(self, engine, model: ModelInfo, loop) -> None:
        """Serve `engine` (an EngineCore, started by the caller after this) on `loop` from now
        on: its steps come to the loop as StepTokens through one hand-off per step, or run
        on the loop when they are shorter than a hand-off (net/writer/handoff.py)."""
        self.dispatcher.attach(engine, model, loop)
        self.handoff = StepHandoff(loop, self.dispatcher.write_step, engine.driver, self.dispatcher.step_times_ns)
        self.model = model
        self.engine = engine
        self.loop = loop
        self.tokenizing = Tokenizing(model.tokenizer)
        self._max_token_bytes = max_token_bytes(model.tokenizer)
        self._bos_ids = list(model.encode(""))

    def detach(self) -> None:
        """The loop is stopping: the engine thread must never wait for it again."""
        self.dispatcher.busy_poll.stop()
        if self.handoff is not None:
            self.handoff.detach()

    def close(self) -> None:
        """Release what the hand-off holds, once the engine thread has stopped."""
        if self.handoff is not None:
            self.handoff.close()
        if self.tokenizing is not None:
            self.tokenizing.close()

    # --------------------------------------------------- connection events

    def connection_made(self, proto) -> None:
        self.connections.add(proto)
        if self.shutting_down:
            proto.begin_shutdown()

    def connection_ended(self, proto) -> None:
        """The shell ended the connection for one of its limits: its requests are cancelled now."""
        self.dispatcher.cancel_all(proto)
        self.grpc.forget(proto)

    def connection_lost(self, proto) -> None:
        self.connections.discard(proto)
        self.dispatcher.cancel_all(proto)
        self.grpc.forget(proto)
        self.metrics.count_closed(proto.close_cause or "peer")

    def on_events(self, proto, events: list) -> None:
        """Everything one read brought, in order.

        Steps the engine finished meanwhile are written first (tokens already made go out
        before new requests are parsed and tokenized); the engine thread is held until the
        new requests are in its inbox, so its next step takes them, and woken once, after
        the last one."""
        try:
            for ev in events:       # the session has closed these streams already: no token may go to them
                if type(ev) is StreamReset:
                    self.dispatcher.cancel(proto, ev.stream_id)
                    self.grpc.forget(proto, ev.stream_id)
            if self.handoff is not None:
                self.handoff.write_pending()
            for ev in events:
                kind = type(ev)
                if kind is Request:
                    self._handle(proto, ev)
                elif kind is RequestMessage:        # a gRPC call's messages, as they come (http2.py rule 11)
                    self.grpc.message(proto, ev)
                elif kind is MessageRequest:
                    self.grpc.open(proto, ev)
                elif kind is RequestEnd:
                    self.grpc.end(proto, ev)
                elif kind is BodyTooLarge and ev.headers.get("content-type", "").startswith("application/grpc"):
                    self.grpc.too_large(proto, ev)
                elif kind is BodyTooLarge:
                    self._respond_error(proto, ev, ApiError(
                        413, f"request body is larger than the limit of {proto.limits.max_body_bytes} bytes",
                        code="body_too_large"))
                elif kind is PriorityUpdate:
                    request_id = proto.outbox.streams.get(ev.stream_id)
                    if request_id is not None:
                        self.engine.set_priority(request_id, urgency(ev.value))
                elif kind is ConnectionClosed:
                    self.dispatcher.cancel_all(proto)
                    self.grpc.forget(proto)
        finally:
            if self.engine is not None:
                self.engine.wake()
                self.handoff.release_engine()

    def _handle(self, proto, req: Request) -> None:
        if req.headers.get("content-type", "").startswith("application/grpc"):
            self.grpc.handle(proto, req)
            return
        try:
            path = req.target.split("?", 1)[0]
            methods = self.routes.get(path)
            if methods is None and path.startswith("/v1/models/"):
                methods = self.routes["/v1/models/"]
            if methods is None:
                raise ApiError(404, f"no route for {path!r}", code="unknown_url")
            handler = methods.get("GET" if req.method == "HEAD" else req.method)
            if handler is None:
                allowed = ", ".join(list(methods) + (["HEAD"] if "GET" in methods else []))
                raise ApiError(405, f"method {req.method} is not allowed on {path}; use {allowed}",
                               code="method_not_allowed", headers=[(b"allow", allowed.encode())])
            handler(proto, req)      # HEAD: the session sends the GET's headers without the body
        except ApiError as exc:
            self._respond_error(proto, req, exc)
        except Exception as exc:  # a bug here must not take the connection down
            log.exception("internal error handling %s %s", req.method, req.target)
            self._respond_error(proto, req, ApiError(
                500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"))

    def _respond_error(self, proto, req: Request | BodyTooLarge, exc: ApiError) -> None:
        """`exc` as the response to `req` (or to a body over the limit), with its access line."""
        if exc.status >= 400 and exc.status not in (404, 405):
            self.metrics.count_request("rejected")
        request_id = self.next_response_id()
        error_body = ERROR_BODIES.get(req.target.split("?", 1)[0], ApiError.body)     # the family's error shape
        try:        # to a HEAD request the session sends the headers only (http1.py, http2.py)
            proto.session.respond(req.stream_id, exc.status, [(b"content-type", JSON)] + exc.headers, error_body(exc),
                                  extra=((b"x-request-id", request_id.encode()),))
        except Exception:       # a response that cannot be written ends its stream, not the connection
            log.exception("could not write the %d response on stream %d", exc.status, req.stream_id)
            proto.session.reset_stream(req.stream_id, ErrorCodes.INTERNAL_ERROR)
        self.access_log.request(proto, req.method, req.target, exc.status, request_id=request_id)

    def _respond(self, proto, req: Request, body: bytes, content_type: bytes = JSON) -> None:
        """A whole 200 response to an info route, with its access line (HEAD: the session drops the body)."""
        request_id = self.next_response_id()
        proto.session.respond(req.stream_id, 200, [(b"content-type", content_type)], body,
                              extra=((b"x-request-id", request_id.encode()),))
        self.access_log.request(proto, req.method, req.target, 200, request_id=request_id)

    def next_response_id(self) -> str:
        """The x-request-id of a response that is not a generation's (info routes, errors, gRPC statuses)."""
        return f"req-{next(self._response_ids)}"

    # ---------------------------------------------------------- info routes

    def _health(self, proto, req) -> None:
        if not self._ready():
            raise ApiError(503, self._not_ready_reason(), code="model_not_ready")
        self._respond(proto, req, b'{"status":"ok"}')

    def _models(self, proto, req) -> None:
        self._authorize(req)
        self._respond(proto, req, orjson.dumps({"object": "list", "data": [self._model_object()]}))

    def _model(self, proto, req) -> None:
        """GET /v1/models/{id}: the OpenAI SDK's models.retrieve."""
        self._authorize(req)
        name = unquote(req.target.split("?", 1)[0][len("/v1/models/"):])
        model = self._require_model()
        if name != model.name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model.name!r}",
                           param="model", code="model_not_found")
        self._respond(proto, req, orjson.dumps(self._model_object()))

    def _model_object(self) -> dict:
        m = self._require_model()
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "tokenwire",
                "max_model_len": m.max_model_len, "description": m.description}

    # ------------------------------------------------------- token routes

    def _tokenize(self, proto, req) -> None:
        """POST /tokenize (vLLM's): a prompt with the model's BOS rule, or messages through the
        chat template; a large text is tokenized on the worker thread, as a generation's is."""
        t = tokenize.parse_tokenize(self._json_body(req), self._on_unknown("/tokenize"))
        self._check_model_name(t.model)
        model = self.model
        if t.messages is not None:
            text = self._render(t.messages, t.tools, t.add_generation_prompt)
            prefix = self._bos_ids if t.add_special_tokens else []
        else:
            text, prefix = t.prompt, self._bos_ids if t.add_special_tokens else []
        def answer(ids):
            self._respond(proto, req, tokenize.tokenize_body(ids, model.max_model_len, model.tokenizer,
                                                             t.return_token_strs))
        if len(text) < LARGE_PROMPT_CHARS:
            answer(prefix + model.tokenizer.encode(text, add_special_tokens=False).ids)
        else:
            job = Submission(proto, req, None, next(self._token_job_ids), 0, None)
            self._off_loop(job, self.tokenizing.submit(text, prefix), answer)

    def _detokenize(self, proto, req) -> None:
        """POST /detokenize (vLLM's): token ids -> text, special tokens included."""
        model_name, ids = tokenize.parse_detokenize(self._json_body(req), self._on_unknown("/detokenize"),
                                                    self.model.tokenizer.get_vocab_size())
        self._check_model_name(model_name)
        self._respond(proto, req, tokenize.detokenize_body(self.model.tokenizer, ids))

    def _count_tokens(self, proto, req) -> None:
        """POST /v1/messages/count_tokens (Anthropic's): the prompt's tokens as /v1/messages
        would submit it."""
        body = self._json_body(req)
        messages, tools = anthropic.parse_count_tokens(body, self._on_unknown("/v1/messages/count_tokens"))
        self._check_model_name(body.get("model"))
        num_tokens = len(self._encode_plain(self._render(messages, tools)))
        self._respond(proto, req, orjson.dumps({"input_tokens": num_tokens}))

    def _check_model_name(self, name) -> None:
        model = self.model
        if name is not None and name != model.name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model.name!r}",
                           param="model", code="model_not_found")

    def _metrics(self, proto, req) -> None:
        self.dispatcher.drain_step_times()
        stats = self.engine.stats() if self.engine is not None else None
        self._respond(proto, req, self.metrics.render(stats, self.budget), b"text/plain; version=0.0.4; charset=utf-8")

    # ----------------------------------------------------- generation routes

    def _generation(self, route: Route, path: str, proto, req) -> None:
        """The one intake path of every API family's generation route (net/api/)."""
        self._submit(proto, req, route.parse(self._json_body(req), self._on_unknown(path)))

    def _on_unknown(self, route: str):
        """parse_*'s `on_unknown` for `route`: log and go on; None (a 400) with --strict-params."""
        return None if self.on_unknown_param is None else self.on_unknown_param[route]

    def _ignore_unknown_param(self, route: str, name: str) -> None:
        key = (route, name)
        if key not in self._unknown_params_logged and len(self._unknown_params_logged) < 1024:
            self._unknown_params_logged.add(key)        # bounded: clients choose the names
            log.info("ignoring the unknown request parameter %r on %s (logged once per name and route; "
                     "--strict-params rejects unknown parameters)", name[:100], route)

    def _json_body(self, req: Request) -> dict:
        self._authorize(req)
        content_type = req.headers.get("content-type")
        if (content_type is not None and content_type != "application/json"
                and content_type.split(";", 1)[0].strip().lower() != "application/json"):
            raise ApiError(415, f"content-type must be application/json, got {content_type!r}",
                           code="unsupported_media_type")
        self._require_model()
        return parse_json(req.body)

    def _submit(self, proto, req: Request, g: GenerationRequest, deadline_ns: int | None = None) -> None:
        """Tokenize (a large prompt on the worker thread), stamp and hand the request to the
        engine; the stream opens with its first token. `deadline_ns` (monotonic; gRPC's
        grpc-timeout): else the x-request-timeout-ms header's."""
        if deadline_ns is None and "x-request-timeout-ms" in req.headers:
            deadline_ns = req.arrived_ns + request_timeout_ns(req.headers["x-request-timeout-ms"])
        model = self.model
        self._check_model_name(g.model)
        if g.params.logprobs is not None and not model.supports_logprobs:
            raise ApiError(400, f"the {model.name!r} engine does not compute logprobs",
                           param="logprobs", code="unsupported_parameter")
        if g.best_of > g.n and not model.supports_logprobs:
            raise ApiError(400, f"best_of > n ranks choices by log-probability; the {model.name!r} engine "
                           "does not compute them", param="best_of", code="unsupported_parameter")
        method = g.params.speculative
        if method is not None and method != "off" and method not in model.speculative_methods:
            offered = ", ".join(model.speculative_methods + ("off",))
            raise ApiError(400, f"speculative {method!r} is not available on this server (it offers: {offered})",
                           param="speculative", code="unsupported_parameter")
        if g.constraint is not None:
            self._check_constraint(g)
        if g.tools is not None:
            g = g._replace(tools=g.tools._replace(family=model.tool_family))
        priority = urgency(req.headers.get("priority"))
        text, encode, prefix = self._prompt(g)
        job = Submission(proto, req, g, next(self._ids), priority, deadline_ns)
        if text is None:
            self._enqueue(job, g.prompt_token_ids)
        elif len(text) < LARGE_PROMPT_CHARS:
            self._enqueue(job, encode(text))
        else:           # a large prompt: tokenized on the worker thread (prompt_limits.py)
            self._off_loop(job, self.tokenizing.submit(text, prefix), lambda ids: self._enqueue(job, ids))

    def _off_loop(self, job: "Submission", future, then) -> None:
        """`job` waits for work on a worker thread (`future`: a tokenization or a grammar compile),
        then `then(result)` runs on the loop. The stream is marked in flight meanwhile (a reset or
        a lost connection unmarks it: then nothing is submitted)."""
        job.proto.outbox.streams[job.req.stream_id] = job.request_id
        future.add_done_callback(lambda f: self._back_on_loop(job, f, then))

    def _back_on_loop(self, job: "Submission", future, then) -> None:
        """The future's callback (worker thread, or the loop): resume on the loop, unless it has
        stopped (the server is going away)."""
        try:
            self.loop.call_soon_threadsafe(self._resume, job, future, then)
        except RuntimeError:
            pass

    def _resume(self, job: "Submission", future, then) -> None:
        proto, req = job.proto, job.req
        streams = proto.outbox.streams
        if proto.closing or streams.get(req.stream_id) != job.request_id or future.cancelled():
            return          # the client left meanwhile
        del streams[req.stream_id]
        try:
            then(future.result())
        except ApiError as exc:
            self._respond_job_error(job, exc)
        except Exception as exc:
            log.exception("internal error preparing %s %s off the loop", req.method, req.target)
            self._respond_job_error(job, ApiError(
                500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"))
        finally:
            self.engine.wake()
            proto.flush()

    def _respond_job_error(self, job: "Submission", exc: ApiError) -> None:
        """A submission's error found off the loop, in its route's protocol: a gRPC status, or
        the HTTP status with its JSON body."""
        if job.g is not None and job.g.route is GRPC:
            self.grpc.respond_status(job.proto, job.req, STATUS_CODES.get(exc.status, UNKNOWN), exc.message)
        else:
            self._respond_error(job.proto, job.req, exc)

    def _check_constraint(self, g: GenerationRequest) -> None:
        model = self.model
        if model.grammars is None:
            raise ApiError(400, f"the {model.name!r} engine ({model.backend}) does no constrained decoding",
                           param=g.constraint_param, code="unsupported_parameter")

    def _enqueue(self, job: "Submission", prompt_ids: list, compiled=None) -> None:
        """Check max_tokens against what the context leaves, stamp the request and hand it to
        the engine (woken by the caller). A constrained request's grammar comes from the
        model's cache at once, else is compiled on a worker thread first (`_compile`)."""
        proto, req, g, request_id = job.proto, job.req, job.g, job.request_id
        problem = max_tokens_problem(g.params.max_tokens, len(prompt_ids), self.model.max_model_len)
        if problem is not None:
            raise bad_param(g.route.max_tokens_param, problem.replace("max_tokens", g.route.max_tokens_param))
        constraint = None
        if g.constraint is not None:
            compiled = compiled or self.model.grammars.cached(g.constraint)
            if compiled is None:        # not compiled before: on a worker thread first
                future = self.loop.run_in_executor(None, self._compile, g)
                return self._off_loop(job, future, lambda done: self._enqueue(job, prompt_ids, done))
            constraint = compiled.constraint()
        timeline = Timeline(arrived_ns=req.arrived_ns, tokenized_ns=time.monotonic_ns())
        if compiled is not None:
            timeline.grammar_compile_ns = compiled.compile_ns
        try:
            if g.best_of == 1:
                self.engine.add_request(request_id, prompt_ids, g.params, timeline, wake=False, priority=job.priority,
                                        constraint=constraint)
            else:
                members = self._submit_choices(request_id, prompt_ids, g, timeline, job.priority)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full", headers=[(b"retry-after", b"1")]) from None
        except PromptTooLong as exc:
            raise ApiError(400, str(exc), param=g.route.prompt_param, code="context_length_exceeded") from None
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_prompt") from None
        self.metrics.tokenize.observe_ns(timeline.tokenized_ns - timeline.arrived_ns)
        self.engine_log.num_prompt_tokens += len(prompt_ids)
        created = int(time.time())
        response_id = f"{g.route.id_prefix}{request_id}"
        if g.best_of > 1:
            self._add_choices(proto, req, g, members, response_id, created, len(prompt_ids), job.deadline_ns)
            return
        # chat streams a named function's arguments token by token; other tool-calling streams
        # are read back, and sent, once complete
        stream_tokens = g.stream and (g.tools is None or g.tools.mode == "named" and g.route.streams_named_tool)
        encoder = self._encoder(g, req, response_id, created, num_prompt=len(prompt_ids)) if stream_tokens else None
        ex = Exchange(request_id, proto, req.stream_id, g, encoder, stream_tokens,
                      timeline, response_id, created, g.params.logprobs is not None, req.method, req.target)
        if g.tools is not None and not stream_tokens:
            ex.tools = g.tools
        self.dispatcher.add(ex, job.deadline_ns)

    def _compile(self, g: GenerationRequest):
        """Worker thread: compile `g`'s grammar; an invalid one is a 400 naming the problem."""
        try:
            return self.model.grammars.compile(g.constraint)
        except InvalidConstraint as exc:
            raise ApiError(400, str(exc), param=g.constraint_param, code="invalid_constraint") from None

    def _submit_choices(self, request_id: int, prompt_ids: list, g: GenerationRequest, timeline: Timeline,
                        priority: int) -> list:
        """n > 1 / best_of: one engine request per choice (net/writer/choices.py), ids request_id,
        then fresh ones. -> [(request id, timeline)] by choice index"""
        params = g.params
        if g.best_of > g.n and params.logprobs is None:
            params = replace(params, logprobs=0)        # the ranking needs each token's log-probability
        ids = [request_id] + [next(self._ids) for _ in range(g.best_of - 1)]
        timelines = [timeline] + [Timeline(arrived_ns=timeline.arrived_ns, tokenized_ns=timeline.tokenized_ns)
                                  for _ in ids[1:]]
        self.engine.add_choices(ids, prompt_ids, choice_params(params, g.best_of), timelines, priority, wake=False)
        return list(zip(ids, timelines))

    def _add_choices(self, proto, req: Request, g: GenerationRequest, members: list, response_id: str,
                     created: int, num_prompt: int = 0, deadline_ns: int | None = None) -> None:
        """n > 1 / best_of: one exchange per choice, each with the request's deadline (they all
        end with finish reason "deadline" when it passes)."""
        group = ChoiceGroup(g.n)
        for i, (request_id, timeline) in enumerate(members):
            encoder = self._encoder(g, req, response_id, created, i, num_prompt) if g.stream else None
            ex = Exchange(request_id, proto, req.stream_id, g, encoder, g.stream, timeline,
                          response_id, created, g.params.logprobs is not None, req.method, req.target)
            group.add(ex)
            self.dispatcher.add(ex, deadline_ns)

    def _prompt(self, g: GenerationRequest) -> tuple:
        """-> (text, encode, ids before the text's) for a text prompt, within the context by its
        byte length (prompt_limits.py); (None, None, None) for token ids."""
        model = self.model
        if g.route.chat:
            text, encode, prefix = self._render(g.messages, g.template_tools), self._encode_plain, []
        elif g.prompt_token_ids is not None:
            return None, None, None
        elif not g.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
        else:
            text, encode, prefix = g.prompt, model.encode, self._bos_ids
        token_bytes = self._max_token_bytes
        if token_bytes is not None and len(text) >= model.max_model_len:
            num_tokens = len(prefix) + min_prompt_tokens(text, token_bytes)
            if num_tokens >= model.max_model_len:
                raise ApiError(400, f"the prompt has at least {num_tokens} tokens (no token covers more than "
                               f"{token_bytes} bytes); this model's context is {model.max_model_len} tokens, "
                               f"so a prompt may have at most {model.max_model_len - 1}",
                               param=g.route.prompt_param, code="context_length_exceeded")
        return text, encode, prefix

    def _render(self, messages: list, tools: list | None, add_generation_prompt: bool = True) -> str:
        model = self.model
        if model.chat_template is None:
            raise ApiError(400, f"the model {model.name!r} has no chat template; use /v1/completions, "
                           "or start the server with --chat-template FILE", code="no_chat_template")
        return model.chat_template.render(messages, add_generation_prompt, tools=tools)

    def _encode_plain(self, text: str) -> list:
        """A rendered chat template -> ids, adding nothing: templates write their own BOS."""
        return self.model.tokenizer.encode(text, add_special_tokens=False).ids

    def _encoder(self, g: GenerationRequest, req: Request, response_id: str, created: int, index: int = 0,
                 num_prompt: int = 0):
        """The request's streamed encoder, from its family's row."""
        return g.route.stream_encoder(g, self.dispatcher.served, response_id, created, index, num_prompt, req.headers)

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
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key):
            return
        key = req.headers.get("x-api-key")         # Anthropic's clients send this instead
        if key is not None and hmac.compare_digest(key.strip().encode(), self.api_key):
            return
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])

    # ------------------------------------------------------------ shutdown

    def begin_shutdown(self) -> None:
        """GOAWAY / Connection: close on every connection; in-flight streams run to their end."""
        self.shutting_down = True
        self.grpc.notify_watchers(end=True)        # health watchers hear NOT_SERVING, their streams end
        self.grpc.end_streams()                    # and open bidirectional calls end UNAVAILABLE
        for proto in list(self.connections):
            proto.close_cause = proto.close_cause or "shutdown"
            proto.begin_shutdown()

    def sweep(self) -> None:
        """Every connection's deadlines (protocol.py: handshake, idle, write); called periodically.
        A stream reset for its write timeout has its request cancelled."""
        self._sweep_some(list(self.connections), time.monotonic())

    def _sweep_some(self, protos: list, now: float) -> None:
        """`SWEEP_BATCH` connections per pass of the loop, the rest in the next: connections that
        reach a deadline together (500 slowloris connections opened at once) are ended a batch
        at a time, never in one stall of the loop."""
        for proto in protos[:SWEEP_BATCH]:
            for stream_id in proto.check_deadlines(now):
                self.dispatcher.cancel(proto, stream_id)
                self.grpc.forget(proto, stream_id)
        if len(protos) > SWEEP_BATCH and self.loop is not None:
            self.loop.call_soon(self._sweep_some, protos[SWEEP_BATCH:], now)
        elif len(protos) > SWEEP_BATCH:
            self._sweep_some(protos[SWEEP_BATCH:], now)


def request_timeout_ns(value: str) -> int:
    """The x-request-timeout-ms header (a positive number of milliseconds) -> nanoseconds."""
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not 0 < ms <= 86_400_000:
        raise ApiError(400, f"x-request-timeout-ms must be a number of milliseconds in (0, 86400000], got {value!r}",
                       param="x-request-timeout-ms", code="invalid_header")
    return int(ms * 1e6)

