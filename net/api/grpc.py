"""gRPC on the HTTP/2 port: the same sessions, loop, engine and dispatcher as the HTTP routes.

A request whose content-type is `application/grpc[+proto]` comes here from the app
(net/app.py). gRPC is HTTP/2 with length-prefixed messages (1 byte compressed flag, 4 bytes
big-endian length, the message) and its status in trailers; every rule below is from
gRPC's "PROTOCOL-HTTP2" specification:

- Delivery: the HTTP/2 session hands over a call as it arrives (http2.py rule 11): its
  headers (`open`: method, encoding and deadline checked at once), each message as soon as
  it is complete (`message`), the client's half-close (`end`). A method in `streaming`
  (reflection's bidirectional ServerReflectionInfo) answers each message as it comes, on a
  stream the client may hold open; the others (unary, server streaming) take their one
  message at the half-close, as gRPC servers do, and a second message is UNIMPLEMENTED at
  once. A message over --max-body-bytes is RESOURCE_EXHAUSTED; a client's RST_STREAM
  forgets the call (`forget`); at shutdown a streaming call ends UNAVAILABLE. A complete
  request (an h2c upgrade's stream 1) goes to `handle`.

- Services: `tokenwire.v1.Generator` (Generate: server streaming; ListModels: unary; the
  schema is net/api/proto/tokenwire.proto; Generate's `constraint` oneof goes through the HTTP
  routes' guided_* rules, net/api/structured.py), `grpc.health.v1.Health` (Check, Watch: SERVING
  while /health answers 200), and server reflection (`grpc.reflection.v1alpha` and `v1`).
- Status: every response is HEADERS (:status 200) then messages then trailers with
  `grpc-status` and a percent-encoded `grpc-message`. Route errors map to codes by their
  HTTP status (`STATUS_CODES`); an unknown method is UNIMPLEMENTED.
- Deadlines: `grpc-timeout` (1-8 digits and a unit H M S m u n) sets the request's deadline;
  when it passes, the request is cancelled in the engine (its KV blocks are free after the
  next step) and the stream ends with DEADLINE_EXCEEDED (dispatch.py, `Dispatcher.expire`).
- Cancellation: the client's RST_STREAM cancels the engine request like any HTTP stream.
- Compression: a message with the compressed flag is gunzipped when `grpc-encoding` is
  gzip; any other encoding is UNIMPLEMENTED with `grpc-accept-encoding: identity,gzip`, and
  a compressed flag without an encoding is INTERNAL. Responses are never compressed.
- Authentication: with --api-key, the `authorization: Bearer KEY` metadata, else UNAUTHENTICATED.
- Generate's token messages are hand-encoded (`token_message`: two fields; measured side by
  side, framed, 2.7 µs against 6.7 µs for the protobuf class, medians on the loaded shared
  2-core machine), checked byte for byte against the protobuf classes in the tests; every
  other message goes through the protobuf classes of net/api/grpc_schema.py.
"""

import logging
import struct
import zlib
from urllib.parse import quote

from ...core.constraint import ConstraintSpec
from ...core.sampling_params import InvalidParameter, SamplingParams
from . import grpc_schema as schema
from .errors import ApiError
from .route import GenerationRequest, Route
from .structured import guided_constraint
from ..protocol.events import MessageRequest, Request, RequestEnd, RequestMessage
from ..protocol.http2 import H2Session

# status codes (grpc/doc/statuscodes.md)
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 8, 12, 13, 14, 16
# an HTTP route error's status -> its gRPC code
STATUS_CODES = {400: INVALID_ARGUMENT, 401: UNAUTHENTICATED, 404: NOT_FOUND, 405: UNIMPLEMENTED,
                413: RESOURCE_EXHAUSTED, 415: INVALID_ARGUMENT, 429: RESOURCE_EXHAUSTED, 500: INTERNAL,
                503: UNAVAILABLE, 504: DEADLINE_EXCEEDED}

RESPONSE_HEADERS = ((b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity,gzip"))
ACCEPTED_ENCODINGS = ("identity", "gzip")
_PREFIX = struct.Struct(">BI")
_TIMEOUT_UNITS_NS = {"H": 3600 * 10**9, "M": 60 * 10**9, "S": 10**9, "m": 10**6, "u": 10**3, "n": 1}
SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3
_TIMING_FIELDS = frozenset(f.name for f in schema.GenerateResponse.DESCRIPTOR.fields_by_name["final"]
                           .message_type.fields_by_name["timings"].message_type.fields)
GENERATOR = "tokenwire.v1.Generator"
SERVICES = (GENERATOR, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
            "grpc.reflection.v1.ServerReflection")


log = logging.getLogger("tokenwire.net")


class GrpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# ------------------------------------------------------------------ framing (sans-IO)

def frame(message: bytes) -> bytes:
    """One length-prefixed, uncompressed message."""
    return _PREFIX.pack(0, len(message)) + message


def split_messages(body: bytes, encoding: str | None, limit: int) -> list:
    """The request body's messages, each decompressed to at most `limit` bytes. Raises GrpcError."""
    messages, pos, n = [], 0, len(body)
    while pos < n:
        if n - pos < 5:
            raise GrpcError(INTERNAL, "the request body ends inside a message's 5-byte prefix")
        compressed, length = _PREFIX.unpack_from(body, pos)
        end = pos + 5 + length
        if end > n:
            raise GrpcError(INTERNAL, f"a message of {length} bytes is cut off at {n - pos - 5}")
        message = body[pos + 5:end]
        if compressed:
            message = _decompress(message, encoding, limit)
        messages.append(message)
        pos = end
    return messages


def _decompress(message: bytes, encoding: str | None, limit: int) -> bytes:
    """A gzip message, inflated to at most `limit` bytes (--max-body-bytes): a few KB of gzip
    can inflate to gigabytes, so the limit holds for what it becomes, not what was sent
    (RESOURCE_EXHAUSTED past it)."""
    if encoding in (None, "identity"):
        raise GrpcError(INTERNAL, "a message has the compressed flag but the request names no grpc-encoding")
    out, rest = bytearray(), message
    try:
        while rest:                                 # gzip members, one after another (RFC 1952)
            inflate = zlib.decompressobj(wbits=31)
            out += inflate.decompress(rest, limit + 1 - len(out))
            if len(out) > limit:
                raise GrpcError(RESOURCE_EXHAUSTED, f"a gzip message inflates past the limit of {limit} bytes "
                                                    f"(--max-body-bytes)")
            if not inflate.eof:
                raise GrpcError(INTERNAL, "a gzip message does not decompress: it ends inside its stream")
            rest = inflate.unused_data
    except zlib.error as exc:
        raise GrpcError(INTERNAL, f"a gzip message does not decompress: {exc}") from None
    return bytes(out)


def parse_timeout(value: str) -> int:
    """grpc-timeout -> nanoseconds. Raises GrpcError."""
    digits, unit = value[:-1], value[-1:]
    if not (1 <= len(digits) <= 8 and digits.isascii() and digits.isdigit()) or unit not in _TIMEOUT_UNITS_NS:
        raise GrpcError(INTERNAL, f"grpc-timeout {value!r} is not 1-8 digits and a unit (H M S m u n)")
    return int(digits) * _TIMEOUT_UNITS_NS[unit]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [_varint(i) for i in range(1 << 14)]


def varint(value: int) -> bytes:
    return _SMALL_VARINTS[value] if value < 16384 else _varint(value)


def token_message(token_ids, text: str) -> bytes:
    """A framed GenerateResponse{token_ids, text}, encoded by hand (hot path: once per token).
    The same bytes as schema.GenerateResponse(token_ids=..., text=...).SerializeToString()."""
    ids = b"".join([varint(t) for t in token_ids])
    body = b"\x0a" + varint(len(ids)) + ids if ids else b""
    if text:
        raw = text.encode()
        body += b"\x12" + varint(len(raw)) + raw
    return _PREFIX.pack(0, len(body)) + body


def status_trailers(code: int, message: str = "", extra: list | None = None) -> list:
    trailers = [(b"grpc-status", str(code).encode())]
    if message:
        trailers.append((b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
    return trailers + (extra or [])


# ------------------------------------------------------------------ Generate's stream

class GenerateEncoder:
    """Generate's response stream, for the dispatcher (the interface of encoders.py's):
    one message per output, a final message, and the status in trailers."""
    content_type = b"application/grpc"
    response_headers = RESPONSE_HEADERS
    in_band_errors = True           # an engine failure is a status in trailers, never an HTTP 500
    __slots__ = ()

    def first_token(self, out) -> bytes:
        return self.token(out)

    def token(self, out) -> bytes:
        """Hot path: once per token. (b"" for a request's last output: `finish` sends it.)"""
        if out.logprobs is None:
            return token_message(out.token_ids, out.text) if out.finish_reason is None else b""
        return b"" if out.finish_reason is not None else frame(self._message(out).SerializeToString())

    @staticmethod
    def _message(out):
        message = schema.GenerateResponse(token_ids=out.token_ids, text=out.text)
        for lp in out.logprobs or ():
            message.logprobs.add(logprob=lp.token_logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
        return message

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        """The last message: the request's last token and text, if any, with `final`
        (one message, so a client counting messages counts tokens)."""
        if error is not None or finish_reason == "deadline":
            return token_message(out.token_ids, out.text) if out.token_ids or out.text else b""
        message = self._message(out)
        final = message.final
        final.finish_reason = finish_reason
        final.usage.prompt_tokens = use["prompt_tokens"]
        final.usage.completion_tokens = use["completion_tokens"]
        final.usage.total_tokens = use["total_tokens"]
        final.usage.cached_tokens = use["prompt_tokens_details"]["cached_tokens"]
        for name, value in timings.items():
            if name in _TIMING_FIELDS:      # (the HTTP routes' timings also carry cache facts)
                setattr(final.timings, name, value)
        return frame(message.SerializeToString())

    def trailers(self, base: list, finish_reason: str, error: str | None) -> list:
        code = self.status(finish_reason, error)
        if code == INTERNAL:
            return status_trailers(INTERNAL, f"the engine failed this request: {error}", base)
        if code == DEADLINE_EXCEEDED:
            return status_trailers(DEADLINE_EXCEEDED, "the deadline (grpc-timeout) passed", base)
        return status_trailers(OK, "", base)

    @staticmethod
    def status(finish_reason: str, error: str | None) -> int:
        """The grpc-status the call ends with (its trailers; the access line)."""
        return INTERNAL if error is not None else DEADLINE_EXCEEDED if finish_reason == "deadline" else OK


def _generate_encoder(g, served, response_id, created, index, num_prompt, headers):
    return GenerateEncoder()


# Generate's row among the API families' (net/api/route.py); reached by content-type, not by path
GRPC = Route("grpc", None, "grpc-", "text", _generate_encoder, None, allows_token_ids=True)


# ------------------------------------------------------------------ the routes

class Call:
    """A call whose request is still coming (http2.py rule 11), from `open` to its end."""
    __slots__ = ("req", "method", "on_message", "encoding", "deadline_ns", "messages", "request_id")

    def __init__(self, req, method, on_message, encoding: str | None, deadline_ns: int | None):
        self.req = req                  # the MessageRequest (or Request): stream id, target, headers
        self.method = method            # the whole-request method: (proto, req, messages, deadline_ns)
        self.on_message = on_message    # a streaming method's (proto, call, message); None: `method` at the end
        self.encoding = encoding        # grpc-encoding, for compressed messages
        self.deadline_ns = deadline_ns  # monotonic; None: no grpc-timeout
        self.messages = []              # a non-streaming method's message, kept until the half-close
        self.request_id = None          # x-request-id once the response started


class GrpcRoutes:
    """The gRPC methods, called by the app for `application/grpc` requests. Part of the app:
    it uses the app's guards (`_authorize`, `_require_model`, `_ready`) and its `_submit`,
    as the HTTP routes do."""

    def __init__(self, app):
        self.app = app
        self.watchers = []          # Health.Watch streams: [proto, stream_id, service, last status sent]
        self.calls = {}             # proto -> {stream id -> Call}: calls whose request is still coming
        self.methods = {
            f"/{GENERATOR}/Generate": self._generate,
            f"/{GENERATOR}/ListModels": self._list_models,
            "/grpc.health.v1.Health/Check": self._health_check,
            "/grpc.health.v1.Health/Watch": self._health_watch,
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": self._reflection,
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": self._reflection,
        }
        # methods that answer each request message as it comes (bidirectional streams)
        self.streaming = {
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": self._reflection_message,
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": self._reflection_message,
        }

    def handle(self, proto, req: Request) -> None:
        """A complete request: its method on all its messages."""
        self._answering(proto, req, self._handle_whole, proto, req)

    def _handle_whole(self, proto, req: Request) -> None:
        call = self._new_call(proto, req)
        call.method(proto, req, split_messages(req.body, call.encoding, proto.limits.max_body_bytes), call.deadline_ns)

    def _new_call(self, proto, req) -> Call:
        """The call `req`'s headers ask for. Raises GrpcError, ApiError (505: not HTTP/2)."""
        if not isinstance(proto.session, H2Session):
            raise ApiError(505, "gRPC needs HTTP/2", code="http2_required")
        method = self.methods.get(req.target)
        if req.method != "POST" or method is None:
            raise GrpcError(UNIMPLEMENTED, f"no method {req.method} {req.target}")
        encoding = req.headers.get("grpc-encoding")
        if encoding is not None and encoding not in ACCEPTED_ENCODINGS:
            raise GrpcError(UNIMPLEMENTED, f"grpc-encoding {encoding!r} is not supported; use identity or gzip")
        timeout = req.headers.get("grpc-timeout")
        deadline_ns = req.arrived_ns + parse_timeout(timeout) if timeout is not None else None
        return Call(req, method, self.streaming.get(req.target), encoding, deadline_ns)

    # ---------------------------------------------------------- a call as it arrives

    def open(self, proto, req: MessageRequest) -> None:
        """A call's headers: checked now (an error is the whole answer); its messages follow."""
        call = self._answering(proto, req, self._new_call, proto, req)
        if call is not None:
            self.calls.setdefault(proto, {})[req.stream_id] = call

    def message(self, proto, ev: RequestMessage) -> None:
        """One request message: a streaming method answers it now; another keeps it (counted in
        the session's body bytes) until the half-close."""
        call = self.calls.get(proto, {}).get(ev.stream_id)
        if call is not None:
            self._answering(proto, call.req, self._on_message, proto, call, ev)

    def _on_message(self, proto, call: Call, ev: RequestMessage) -> None:
        message = _decompress(ev.message, call.encoding, proto.limits.max_body_bytes) if ev.compressed else ev.message
        if call.on_message is not None:
            call.on_message(proto, call, message)
        elif call.messages:
            raise GrpcError(UNIMPLEMENTED, "this method takes exactly one request message, got more")
        else:
            call.messages.append(message)
            proto.session.keep_message(ev.stream_id, len(message))

    def end(self, proto, ev: RequestEnd) -> None:
        """The client half-closed: a streaming call ends OK, any other runs its method now."""
        call = self.calls.get(proto, {}).get(ev.stream_id)
        if call is not None:
            self._answering(proto, call.req, self._on_end, proto, call, ev.num_cut_bytes)
            self.forget(proto, ev.stream_id)

    def _on_end(self, proto, call: Call, num_cut_bytes: int) -> None:
        if num_cut_bytes:
            raise GrpcError(INTERNAL, f"the request ends {num_cut_bytes} bytes into an incomplete message")
        if call.on_message is None:
            call.method(proto, call.req, call.messages, call.deadline_ns)
        else:
            self._close_call(proto, call, OK, "")

    def too_large(self, proto, ev) -> None:
        """A message (or a whole request) over --max-body-bytes: RESOURCE_EXHAUSTED, also on a
        stream whose response has started."""
        message = f"the request is larger than the limit of {proto.limits.max_body_bytes} bytes"
        call = self.calls.get(proto, {}).get(ev.stream_id)
        if call is None:
            self.respond_status(proto, ev, RESOURCE_EXHAUSTED, message)
        else:
            self.forget(proto, ev.stream_id)
            self._close_call(proto, call, RESOURCE_EXHAUSTED, message)

    def forget(self, proto, stream_id: int | None = None) -> None:
        """The call on `stream_id` is over, or gone with its stream; None: every call of the
        connection (it closed)."""
        calls = self.calls.get(proto)
        if calls is not None:
            if stream_id is not None:
                calls.pop(stream_id, None)
            if stream_id is None or not calls:
                del self.calls[proto]

    def end_streams(self) -> None:
        """Shutdown: every streaming call ends UNAVAILABLE (retry elsewhere), so a client that
        holds one open does not hold the drain; the others finish at their half-close."""
        for proto, calls in list(self.calls.items()):
            for call in [c for c in calls.values() if c.on_message is not None]:
                self.forget(proto, call.req.stream_id)
                self._close_call(proto, call, UNAVAILABLE, "the server is shutting down")
            proto.flush()

    def _answering(self, proto, req, fn, *args):
        """fn(*args); an error it raises is the call's status (-> None), and ends the call."""
        try:
            return fn(*args)
        except GrpcError as exc:
            self._fail(proto, req, exc.code, exc.message)
        except ApiError as exc:
            if exc.status == 505:
                raise
            self._fail(proto, req, STATUS_CODES.get(exc.status, UNKNOWN), exc.message)
        except InvalidParameter as exc:
            self._fail(proto, req, INVALID_ARGUMENT, str(exc))
        return None

    def _fail(self, proto, req, code: int, message: str) -> None:
        call = self.calls.get(proto, {}).get(req.stream_id)
        if call is None:
            self.respond_status(proto, req, code, message)
        else:
            self.forget(proto, req.stream_id)
            self._close_call(proto, call, code, message)

    def _send(self, proto, call: Call, messages: bytes) -> None:
        """Framed messages on a streaming call's response (its headers first, once)."""
        session, sid = proto.session, call.req.stream_id
        if call.request_id is None:
            call.request_id = self.app.next_response_id()
            session.start_response(sid, 200, RESPONSE_HEADERS, ((b"x-request-id", call.request_id.encode()),))
        session.send_data(sid, messages)

    def _close_call(self, proto, call: Call, code: int, message: str) -> None:
        """A streaming call's status: its trailers (a whole response if nothing was sent)."""
        req = call.req
        if call.request_id is None:
            self.respond_status(proto, req, code, message)
            return
        if req.stream_id in proto.session.streams:
            proto.session.end_response(req.stream_id, status_trailers(code, message))
        self.app.access_log.request(proto, req.method, req.target, 200, request_id=call.request_id,
                                    grpc_status=code)

    def respond_status(self, proto, req: Request, code: int, message: str, messages: bytes = b"") -> None:
        """A whole response: headers (with its x-request-id), `messages` (framed), the status in
        trailers; the access line shows the grpc-status beside the HTTP status (always 200)."""
        session = proto.session
        request_id = self.app.next_response_id()
        session.start_response(req.stream_id, 200, RESPONSE_HEADERS, ((b"x-request-id", request_id.encode()),))
        if messages:
            session.send_data(req.stream_id, messages)
        session.end_response(req.stream_id, status_trailers(code, message))
        self.app.access_log.request(proto, req.method, req.target, 200, request_id=request_id, grpc_status=code)

    # ---------------------------------------------------------- Generator

    def _generate(self, proto, req: Request, messages: list, deadline_ns) -> None:
        g = generation_request(_one(messages, schema.GenerateRequest))
        self.app._authorize(req)
        self.app._require_model()
        self.app._submit(proto, req, g, deadline_ns)

    def _list_models(self, proto, req: Request, messages: list, deadline_ns) -> None:
        self.app._authorize(req)
        m = self.app._require_model()
        reply = schema.ListModelsResponse()
        reply.models.add(id=m.name, owned_by="tokenwire", created=m.created, max_model_len=m.max_model_len,
                         description=m.description)
        self.respond_status(proto, req, OK, "", frame(reply.SerializeToString()))

    # ---------------------------------------------------------- Health

    def serving_status(self, service: str) -> int | None:
        if service not in ("", GENERATOR):
            return None
        return SERVING if self.app._ready() and not self.app.shutting_down else NOT_SERVING

    def _health_check(self, proto, req: Request, messages: list, deadline_ns) -> None:
        service = _one(messages, schema.HealthCheckRequest).service
        status = self.serving_status(service)
        if status is None:
            raise GrpcError(NOT_FOUND, f"unknown service {service!r}")
        self.respond_status(proto, req, OK, "", _health_message(status))

    def _health_watch(self, proto, req: Request, messages: list, deadline_ns) -> None:
        service = _one(messages, schema.HealthCheckRequest).service
        status = self.serving_status(service)
        status = SERVICE_UNKNOWN if status is None else status
        request_id = self.app.next_response_id().encode()
        proto.session.start_response(req.stream_id, 200, RESPONSE_HEADERS, ((b"x-request-id", request_id),))
        proto.session.send_data(req.stream_id, _health_message(status))
        self.watchers.append([proto, req.stream_id, service, status])

    def notify_watchers(self, end: bool = False) -> None:
        """Send each Watch stream its service's status if it changed (the server calls this
        periodically and at shutdown; `end`: then end the streams with OK)."""
        live = []
        for watcher in self.watchers:
            proto, stream_id, service, last = watcher
            if proto.closing or stream_id not in proto.session.streams:
                continue                    # the client went away
            status = self.serving_status(service)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                proto.session.send_data(stream_id, _health_message(status))
                watcher[3] = status
            if end:
                proto.session.end_response(stream_id, status_trailers(OK))
            else:
                live.append(watcher)
            proto.flush()
        self.watchers = live

    # ---------------------------------------------------------- reflection

    def _reflection(self, proto, req: Request, messages: list, deadline_ns) -> None:
        """A whole request's reflection messages, answered in one response."""
        replies = b"".join(frame(reflection_reply(_parse(m, schema.ReflectionRequest)).SerializeToString())
                           for m in messages)
        self.respond_status(proto, req, OK, "", replies)

    def _reflection_message(self, proto, call: Call, message: bytes) -> None:
        """One reflection request on a stream that stays open: its reply goes out now."""
        reply = reflection_reply(_parse(message, schema.ReflectionRequest))
        self._send(proto, call, frame(reply.SerializeToString()))


def reflection_reply(request):
    """One ServerReflectionResponse for one request (list_services, file_by_filename, file_containing_symbol)."""
    reply = schema.ReflectionResponse(valid_host=request.host, original_request=request)
    kind = request.WhichOneof("message_request")
    if kind == "list_services":
        for name in SERVICES:
            reply.list_services_response.service.add(name=name)
        return reply
    name = None
    if kind == "file_by_filename":
        name = request.file_by_filename if request.file_by_filename in schema.FILE_BYTES else None
    elif kind == "file_containing_symbol":
        symbol = request.file_containing_symbol
        if symbol.startswith("grpc.reflection.v1."):        # served under both packages
            symbol = "grpc.reflection.v1alpha." + symbol[len("grpc.reflection.v1."):]
        name = schema.file_containing_symbol(symbol)
    if name is not None:
        reply.file_descriptor_response.file_descriptor_proto.append(schema.FILE_BYTES[name])
        return reply
    reply.error_response.error_code = NOT_FOUND
    reply.error_response.error_message = f"not found: {kind} {getattr(request, kind or 'host')!r}"
    return reply


def generation_request(m) -> GenerationRequest:
    """A GenerateRequest message -> the routes' GenerationRequest. Raises GrpcError, InvalidParameter."""
    if bool(m.text) == bool(m.token_ids):
        raise GrpcError(INVALID_ARGUMENT, "give exactly one of text and token_ids")
    kwargs = {"stop": tuple(m.stop), "stop_token_ids": tuple(m.stop_token_ids), "ignore_eos": m.ignore_eos,
              "min_tokens": m.min_tokens, "top_k": m.top_k, "min_p": m.min_p,
              "frequency_penalty": m.frequency_penalty, "presence_penalty": m.presence_penalty}
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs",
                 "skip_special_tokens"):
        if m.HasField(name):
            kwargs[name] = getattr(m, name)
    if "max_tokens" in kwargs and kwargs["max_tokens"] == 0:
        raise GrpcError(INVALID_ARGUMENT, "max_tokens must be >= 1 (leave it out for the rest of the context)")
    params = SamplingParams(**kwargs)
    return GenerationRequest(GRPC, m.text or None, list(m.token_ids) or None, None, params, True, False, False,
                             m.model or None, constraint=_constraint(m), constraint_param=m.WhichOneof("constraint"))


# GenerateRequest's constraint fields -> the HTTP routes' guided_* keys (net/api/structured.py)
_GUIDED = {"json_schema": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
           "choice": "guided_choice"}


def _constraint(m):
    """The request's `constraint` oneof -> a ConstraintSpec (None: unconstrained), by the same
    rules as the HTTP routes; a bad one is a 400, which `handle` answers as INVALID_ARGUMENT."""
    field = m.WhichOneof("constraint")
    if field is None or (field == "json_object" and not m.json_object):
        return None
    if field == "json_object":
        return ConstraintSpec("json_object", "")
    value = list(m.choice.choices) if field == "choice" else getattr(m, field)
    return guided_constraint(_GUIDED[field], value, name=field)


def _one(messages: list, cls):
    if len(messages) != 1:
        raise GrpcError(INTERNAL if not messages else UNIMPLEMENTED,
                        f"this method takes exactly one request message, got {len(messages)}")
    return _parse(messages[0], cls)


def _parse(message: bytes, cls):
    try:
        return cls.FromString(message)
    except Exception as exc:        # protobuf's DecodeError, or a wrong wire type
        raise GrpcError(INTERNAL, f"the request message does not parse as {cls.DESCRIPTOR.full_name}: {exc}") \
            from None


def _health_message(status: int) -> bytes:
    return frame(schema.HealthCheckResponse(status=status).SerializeToString())
