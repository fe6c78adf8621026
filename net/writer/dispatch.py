"""The per-step writer: an engine step's outputs become frames on every stream, and
exchanges end.

`Dispatcher.write_step(step)` runs on the loop once per engine step (net/writer/handoff.py brings
the step): it encodes each output into its connection's session (one DATA frame per token
per stream), writes every touched connection once (net/writer/outbox.py), and ends the exchanges
that finished: the finish chunk, trailers (`server-timing`), the request's metrics. A
reset stream or a lost connection cancels its request in the engine (`cancel`,
`cancel_all`). Whole (non-streamed) responses are collected here and built by the
request's API family (`Exchange.route.whole_body`, net/api/), as are its errors
(`route.error_body`) and tool calls read back at the end (`route.tools_body`). Every
response, streamed or whole, failed or not, carries the request's response id as
`x-request-id`; a request the engine failed is also a WARNING naming that id and the
engine's reason.

A write that raises (an encoder, the outbox's framing, the session, the finish chunk, tool
read-back, choices) fails its stream alone (`_fail`): a 500 if its response had not
started, else RST_STREAM(INTERNAL_ERROR) (HTTP/1.1: the connection closes before the last
chunk); its request is cancelled in the engine and logged once, as an ERROR naming its id;
the step's other streams go on. The guard is a try per token (free until it raises: Python
3.11's exceptions cost nothing on entry) and, per connection, the outbox's batch, which
goes on chunk by chunk after a fault (net/writer/outbox.py). A connection whose flush raises is
closed, its requests cancelled.
The per-token loop over a step's columns (`_write_columns`) hands its common entries, later
SSE tokens, to C (net/writer/_columns.c) when it was built; its Python body is the whole
behaviour and takes every entry the C code leaves (tests/test_columns_native.py).
"""

import logging
import time
from collections import deque

from h2.errors import ErrorCodes

from ...core.outputs import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, RequestOutput, StepTokens
from ..access_log import AccessLog, peer_name
from ..api import structured
from ..api.errors import ApiError
from ..api.route import Served
from ..metrics import Metrics
from . import choices, encoders
from .busy_poll import BusyPoller

try:                                # the per-token loop's common case in C (net/writer/_columns.c)
    from . import _columns as COLUMNS
except ImportError:                 # built without a compiler: `_write_columns` takes every token
    COLUMNS = None

log = logging.getLogger("tokenwire.net")
JSON = b"application/json"
FINISH_DEADLINE = "deadline"        # the request's deadline passed (grpc-timeout, x-request-timeout-ms)
# step times wait in their deque until this many (or a /metrics read) go into the histogram:
# a drain per step was a Python call and a histogram observe per step of a lone stream
STEP_TIMES_BATCH = 64


class Exchange:
    """One generation request in flight: where its bytes go and how they are encoded."""
    __slots__ = ("request_id", "proto", "outbox", "stream_id", "route", "g", "encoder", "streaming", "timeline",
                 "last_ns", "response_id", "created", "texts", "token_ids", "logprobs", "want_logprobs",
                 "send", "encode", "prefix", "suffix", "splice", "key", "queue", "group", "index", "method", "path",
                 "deadline_timer", "expired", "tools")

    def __init__(self, request_id, proto, stream_id, g, encoder, streaming, timeline, response_id,
                 created, want_logprobs, method="POST", path="-"):
        self.request_id = request_id
        self.proto = proto
        self.outbox = proto.outbox
        self.stream_id = stream_id
        self.g = g                          # the api.route.GenerationRequest
        self.route = g.route                # its family's row (net/api/route.py): bodies, errors
        self.encoder = encoder              # None for whole (non-streamed) responses
        self.streaming = streaming
        self.timeline = timeline
        self.last_ns = 0                    # when the previous token was dispatched (0: none yet)
        self.response_id = response_id
        self.created = created
        whole = not streaming               # whole responses collect their text, ids and logprobs here
        self.texts = [] if whole else None
        self.token_ids = [] if whole else None
        self.logprobs = [] if whole else None
        self.want_logprobs = want_logprobs
        self.method, self.path = method, path   # for the access line
        self.deadline_timer = None          # asyncio.TimerHandle when the request has a deadline
        self.expired = False                # its deadline passed: cancelled in the engine, ending
        self.send = proto.session.data_writer(stream_id)        # made once: called per token
        self.encode = encoder.token if encoder is not None else None
        # SSE: a later token's chunk is prefix + orjson.dumps(text) + suffix, queued as those
        # pieces and spliced as it is framed (net/protocol/frames.py); or splice(text), for
        # encoders whose later chunks are not constant around the text
        self.prefix, self.suffix = encoder.text_parts() if hasattr(encoder, "text_parts") else (None, None)
        self.splice = getattr(encoder, "splice", None) if self.prefix is None else None
        self.key = proto.session.data_key(stream_id)            # such chunks wait in the connection's
        self.queue = proto.outbox.sends.append                  # outbox until the end of the step
        self.group = None                   # n > 1: the ChoiceGroup of the request's choices (net/writer/choices.py)
        self.index = 0                      # the choice's index in it
        self.tools = None                   # structured.ToolPlan: the text is read back as tool calls at the end


class Dispatcher:
    """Exchanges in flight, keyed by engine request id, and the per-step writer."""

    def __init__(self, metrics: Metrics, trace=None, access_log: AccessLog | None = None):
        self.engine = None                  # EngineCore (cancel), set by `attach`
        self.model = None                   # model_info.ModelInfo (name), set by `attach`
        self.served = None                  # api.route.Served: what the families' bodies need, set by `attach`
        self.metrics = metrics
        self.trace = trace                  # trace.TraceWriter or None
        self.access_log = access_log or AccessLog(False)
        self.exchanges: dict[int, Exchange] = {}
        self.step_times_ns = deque()        # filled by the engine (StepHost.step_times_ns), drained here in batches
        self.busy_poll = BusyPoller(self.exchanges)
        self._touched = []                  # outboxes written during this step (Outbox.pending set)
        self._firsts = []                   # exchanges whose first token went out this step
        self.columns = COLUMNS              # net/writer/_columns.c, or None: `_write_columns` takes every token

    def attach(self, engine, model, loop) -> None:
        """Write `engine`'s steps from now on (call on the loop's thread, before the engine starts)."""
        self.engine, self.model = engine, model
        self.served = Served(model.name, engine.detokenizer.token_text, engine.eos_token_ids)
        self.busy_poll.loop = loop

    def add(self, ex: "Exchange", deadline_ns: int | None = None) -> None:
        """Write `ex`'s outputs from now on; `deadline_ns` (monotonic): when to give up on it."""
        self.exchanges[ex.request_id] = ex
        if not ex.index:                    # n > 1: the stream maps to the first choice (net/writer/choices.py)
            ex.outbox.streams[ex.stream_id] = ex.request_id
        if deadline_ns is not None:
            delay_s = max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9)
            ex.deadline_timer = self.busy_poll.loop.call_later(delay_s, self.expire, ex.request_id)

    def expire(self, request_id: int) -> None:
        """The request's deadline passed: cancel it in the engine (its KV blocks are free after
        the next step), which answers with its final output; `_finish` then ends the stream
        with the `deadline` finish reason (gRPC: DEADLINE_EXCEEDED; nothing sent yet: 504)."""
        ex = self.exchanges.get(request_id)
        if ex is not None and not ex.expired:
            ex.expired = True
            self.engine.cancel(request_id)

    def write_step(self, step: StepTokens) -> None:
        """Write one engine step's outputs to every stream (hot path: once per step).

        Frames for all streams of a connection are gathered in its session and leave in
        one transport write per connection. An SSE token chunk waits in its connection's
        outbox as the encoder's `text_parts()` around its text until the loop is done; each
        connection's then become DATA frames in one `session.send_batch` pass, which splices
        and frames them into one bytes object (net/protocol/frames.py, in C when built; same
        frames and windows as one `send_data` each). A stream's finish chunk follows its token at
        once, so that token goes the general way, in order. The inter-token histogram is fed once per run
        of streams whose previous token went out at the same moment (usually the whole
        step: they were all in the previous one), not once per token.

        `step`: the engine's StepTokens (core/outputs.py): its columns are the hot path, a
        later token of an SSE stream; their other entries (a stream's first token, other
        encoders, whole responses) join its rows as RequestOutputs.
        """
        now = time.monotonic_ns()
        exchanges = self.exchanges
        touched = self._touched
        itl = self.metrics.itl
        run_last = run_len = num_tokens = 0
        outputs = step.rows
        step_done_ns = step.step_done_ns or (outputs[0].step_done_ns if outputs else 0)
        if step.request_ids:
            run_last, run_len, num_tokens = self._write_columns(step, now, outputs)
        for out in outputs:
            ex = exchanges.get(out.request_id)
            if ex is None:
                continue            # cancelled: the client is gone
            try:            # free until it raises; then this stream fails alone
                finish = out.finish_reason
                ids = out.token_ids
                if ids:
                    num_tokens += len(ids)
                    if ex.streaming:
                        last = ex.last_ns
                        ex.last_ns = now
                        if last:
                            if last != run_last:
                                if run_len:
                                    itl.observe_many_ns(now - run_last, run_len)
                                run_last, run_len = last, 0
                            run_len += 1
                            prefix = ex.prefix
                            if prefix is not None and finish is None and out.logprobs is None:
                                ex.queue((ex.key, prefix, out.text, ex.suffix))
                            else:               # the finish chunk follows at once: this one goes first
                                if ex.outbox.sends:     # after this stream's earlier tokens of this step
                                    ex.outbox.send_queued()     # (a replayed answer: many in one step)
                                    if ex.outbox.failed:
                                        self._fail_chunks(ex.outbox)
                                        if ex.request_id not in exchanges:
                                            continue    # this stream's own chunk raised
                                chunk = ex.encode(out)
                                if chunk:               # (gRPC's last token goes in its final message)
                                    ex.send(chunk)
                        else:
                            self._open_stream(ex)
                            chunk = ex.encoder.first_token(out)
                            if chunk:
                                ex.send(chunk)
                    else:
                        self._collect(ex, out)
                if finish is not None:
                    self._finish(ex, out, now)
            except Exception as exc:
                self._fail(ex, exc)
                continue
            outbox = ex.outbox
            if not outbox.pending:
                outbox.pending = True
                touched.append(outbox)
        for outbox in touched:              # `_fail` may add to it: its stream's end goes out too
            try:
                outbox.write_step()
            except Exception as exc:        # the connection's flush: no one stream's fault
                self._fail_connection(outbox, exc)
            if outbox.failed:
                self._fail_chunks(outbox)
        touched.clear()
        if run_len:
            itl.observe_many_ns(now - run_last, run_len)
        if num_tokens:
            wire_ns = time.monotonic_ns()
            self.metrics.engine_to_wire.observe_many_ns(wire_ns - step_done_ns, num_tokens)
            self.metrics.streamed_tokens += num_tokens
            if self._firsts:
                self._stamp_first_tokens(wire_ns)
        if len(self.step_times_ns) >= STEP_TIMES_BATCH:
            self.drain_step_times()

    def _write_columns(self, step: StepTokens, now: int, rows: list) -> tuple:
        """The columns of a StepTokens: one token each for requests that go on (hot path:
        once per token). A later token of an SSE stream is spliced and queued here; any
        other entry is appended to `rows` as a RequestOutput for the general loop (its
        token counts are never read: it does not finish). -> (run_last, run_len, num_tokens)
        of the inter-token bookkeeping in `write_step`."""
        exchanges = self.exchanges
        get = exchanges.get
        touched = self._touched
        itl = self.metrics.itl
        run_last = run_len = num_tokens = 0
        ids, token_ids, texts = step.request_ids, step.token_ids, step.texts
        fast = self.columns.write_columns if self.columns is not None else None
        i, num = 0, len(ids)
        while i < num:
            if fast is not None:        # C takes the later SSE tokens; this body every other entry
                i, run_last, run_len, num_tokens = fast(ids, texts, i, exchanges, now, touched, itl.observe_many_ns,
                                                        run_last, run_len, num_tokens)
                if i == num:
                    break
            request_id, token_id, text = ids[i], token_ids[i], texts[i]
            i += 1
            ex = get(request_id)
            if ex is None:
                continue            # cancelled: the client is gone
            last = ex.last_ns
            prefix = ex.prefix
            if not last or prefix is None and ex.splice is None:
                rows.append(RequestOutput(request_id, (token_id,), text, None, None, 0, 0, step.step_done_ns))
                continue
            num_tokens += 1
            ex.last_ns = now
            if last != run_last:
                if run_len:
                    itl.observe_many_ns(now - run_last, run_len)
                run_last, run_len = last, 0
            run_len += 1
            if prefix is not None:      # spliced as it is framed (net/protocol/frames.py)
                ex.queue((ex.key, prefix, text, ex.suffix))
            else:
                try:        # free until it raises; then this stream fails alone
                    ex.queue((ex.key, ex.splice(text)))
                except Exception as exc:
                    num_tokens -= 1
                    self._fail(ex, exc)
                    continue
            outbox = ex.outbox
            if not outbox.pending:
                outbox.pending = True
                touched.append(outbox)
        return run_last, run_len, num_tokens

    def _open_stream(self, ex: Exchange) -> None:
        """Response HEADERS go out with the first token: one write, and TTFT is the first token's.
        The header tuple is the encoder's constant, so its HPACK block is built once per connection."""
        if ex.group is not None and not ex.group.open(ex):
            return                          # another choice's token opened the response
        ex.proto.session.start_response(ex.stream_id, 200, ex.encoder.response_headers, _id_field(ex))
        self._firsts.append(ex)

    def _stamp_first_tokens(self, wire_ns: int) -> None:
        for ex in self._firsts:
            ex.timeline.first_token_emitted_ns = wire_ns
            self.metrics.ttft.observe_ns(wire_ns - ex.timeline.arrived_ns)
        self._firsts.clear()

    def _collect(self, ex: Exchange, out) -> None:
        ex.texts.append(out.text)
        ex.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            if ex.want_logprobs:
                ex.logprobs.extend(out.logprobs)
            if ex.group is not None:
                ex.group.score(ex, out.logprobs)

    def _finish(self, ex: Exchange, out, now: int) -> None:
        del self.exchanges[ex.request_id]
        if ex.group is not None:
            out = self._finish_choice(ex, out)
            if out is None:
                return                      # other choices of the request still run
        if not self.exchanges:
            self.busy_poll.start(now)
        ex.outbox.streams.pop(ex.stream_id, None)
        if ex.deadline_timer is not None:
            ex.deadline_timer.cancel()
        reason = out.finish_reason
        if reason == FINISH_CANCELLED:
            if not ex.expired:
                return                      # the client went away
            reason = FINISH_DEADLINE
        timings = encoders.timings_us(ex.timeline if ex.group is None else ex.group.timeline or ex.timeline, now)
        use = encoders.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        trailers = [(b"server-timing", encoders.server_timing(timings)),
                    (b"tokenwire-cached-tokens", b"%d" % out.num_cached_tokens)]
        timings["cached_prompt_tokens"] = out.num_cached_tokens     # the final chunk says it too
        if ex.timeline.response_cached:
            timings["response_cached"] = True
        error = out.error if reason == FINISH_ERROR else None
        if error is not None:
            log.warning("request %s failed in the engine: %s", ex.response_id, error)
        if ex.timeline.mask_ns or ex.timeline.grammar_compile_ns:
            timings.update(encoders.grammar_timings_us(ex.timeline, out.num_output_tokens))
        if ex.timeline.spec_proposed:       # speculative decoding: proposed and accepted tokens
            timings.update(encoders.spec_counts(ex.timeline))
            trailers += encoders.spec_trailers(ex.timeline)
        opened = ex.last_ns or (ex.group is not None and ex.group.opened)
        if ex.tools is not None and error is None:
            self._respond_tools(ex, reason, use, timings, trailers)
        elif ex.streaming and (opened or ex.encoder.in_band_errors or (error is None and reason != FINISH_DEADLINE)):
            if not ex.last_ns:
                self._open_stream(ex)
            session = ex.proto.session
            body = ex.encoder.finish(out, reason, use, timings, error)
            if body:
                session.send_data(ex.stream_id, body)
            session.end_response(ex.stream_id, ex.encoder.trailers(trailers, reason, error))
        else:               # a whole response, or a stream that failed before its first token: a 500 (504)
            self._respond_whole(ex, reason, use, trailers, error)
        self._record_finish(ex, reason, now, out.num_cached_tokens)
        status = 200 if opened or ex.encoder is not None and ex.encoder.in_band_errors else \
            500 if error is not None else 504 if reason == FINISH_DEADLINE else 200
        grpc_status = ex.encoder.status(reason, error) if ex.encoder is not None and ex.encoder.in_band_errors \
            else None
        self.access_log.request(ex.proto, ex.method, ex.path, status, request_id=ex.response_id,
                                grpc_status=grpc_status, num_prompt=out.num_prompt_tokens,
                                num_output=out.num_output_tokens, ttft_us=timings["ttft_us"],
                                total_us=timings["total_us"], finish=reason)

    def _finish_choice(self, ex: Exchange, out):
        """One choice of an n > 1 request ended (net/writer/choices.py rules 2-3): a streamed one sends
        its finish chunk unless it is the last. -> the output that ends the response, or None"""
        if ex.deadline_timer is not None:
            ex.deadline_timer.cancel()
        last = ex.group.end(ex, out)
        if last is None and ex.streaming and out.finish_reason != FINISH_ERROR:
            if not ex.last_ns:
                self._open_stream(ex)
            reason = FINISH_DEADLINE if out.finish_reason == FINISH_CANCELLED and ex.expired else out.finish_reason
            ex.proto.session.send_data(ex.stream_id, ex.encoder.finish_choice(reason))
        return last

    def _respond_whole(self, ex: Exchange, reason: str, use: dict, trailers: list, error: str | None) -> None:
        session = ex.proto.session
        if error is not None or reason == FINISH_DEADLINE:
            exc = ApiError(500, f"the engine failed this request: {error}", code="engine_error") \
                if error is not None else ApiError(504, "the request's deadline (x-request-timeout-ms) passed "
                                                   "before its response was complete", code="deadline_exceeded")
            session.respond(ex.stream_id, exc.status, [(b"content-type", JSON)], ex.route.error_body(exc), trailers,
                            _id_field(ex))
            return
        served = self.served
        if ex.group is not None:
            body = choices.whole_body(ex.group, ex.route.chat, ex.response_id, ex.created, served.model, use,
                                      ex.want_logprobs, served.token_text)
        else:
            body = ex.route.whole_body(ex.g, served, ex.response_id, ex.created, "".join(ex.texts), reason, use,
                                       ex.token_ids, ex.logprobs if ex.want_logprobs else None)
        session.respond(ex.stream_id, 200, [(b"content-type", JSON)], body, trailers, _id_field(ex))

    def _respond_tools(self, ex: Exchange, reason: str, use: dict, timings: dict, trailers: list) -> None:
        """A request with tools, read back as tool calls (finish reason "tool_calls" when there
        are some) and answered in its family's shape, as a whole body or as one stream."""
        content, calls = structured.tool_calls(ex.tools, "".join(ex.texts), cut=reason == FINISH_LENGTH)
        if calls and reason == "stop":
            reason = "tool_calls"
        headers, body = ex.route.tools_body(ex.g, self.served, ex.response_id, ex.created, content, calls, reason,
                                            use, timings)
        ex.proto.session.respond(ex.stream_id, 200, list(headers), body, trailers, _id_field(ex))

    def _record_finish(self, ex: Exchange, reason: str, now: int, num_cached_tokens: int = 0) -> None:
        m = self.metrics
        t = ex.timeline
        m.count_request(reason if reason in m.requests else "error")
        m.e2e.observe_ns(now - t.arrived_ns)
        if t.first_scheduled_ns and t.queued_ns:
            m.queue.observe_ns(t.first_scheduled_ns - t.queued_ns)
        if self.trace is not None:
            self.trace.add(ex.request_id, ex.route.name, t, now, num_cached_tokens)

    # ------------------------------------------------------------ write faults

    def _fail(self, ex: Exchange, exc: Exception) -> None:
        """Writing `ex`'s stream raised (slow path: once per failed stream; its later tokens
        find no exchange). The stream ends with an error, its request is cancelled in the
        engine (its KV blocks are free after the next step) and logged once; see the module
        docstring."""
        log.error("request %s: writing its response raised; its stream ends with an error and the request is "
                  "cancelled", ex.response_id, exc_info=exc)
        self._drop(ex)
        outbox = ex.outbox
        outbox.streams.pop(ex.stream_id, None)
        if outbox.sends:                    # its chunks queued earlier in this step
            outbox.sends[:] = [item for item in outbox.sends if item[0] != ex.key]
        answered = self._end_failed(ex)
        self.metrics.count_request("error")
        self.access_log.request(ex.proto, ex.method, ex.path, 500 if answered else 200, request_id=ex.response_id)
        if not outbox.pending:              # the stream's end goes out with this step
            outbox.pending = True
            self._touched.append(outbox)

    def _end_failed(self, ex: Exchange) -> bool:
        """End a failed stream through its session (`fail_response`); if even that raises,
        reset it. -> whether the 500 was sent."""
        session = ex.proto.session
        error = ApiError(500, "internal server error: the response could not be written", code="internal_error")
        try:
            return session.fail_response(ex.stream_id, 500, [(b"content-type", JSON)], ex.route.error_body(error),
                                         _id_field(ex))
        except Exception:
            log.debug("request %s: its error response raised too", ex.response_id, exc_info=True)
        try:
            session.reset_stream(ex.stream_id, ErrorCodes.INTERNAL_ERROR)
        except Exception:
            log.debug("request %s: its reset raised too", ex.response_id, exc_info=True)
        return False

    def _fail_chunks(self, outbox) -> None:
        """Chunks whose framing raised in `outbox` (net/writer/outbox.py): their streams fail."""
        failed, outbox.failed = outbox.failed, []
        for key, exc in failed:
            for ex in list(self.exchanges.values()):
                if ex.outbox is outbox and ex.key == key:
                    self._fail(ex, exc)
                    break

    def _fail_connection(self, outbox, exc: Exception) -> None:
        """The connection's write raised: nothing more can be written to it. It is closed and
        each of its requests is cancelled in the engine, counted and logged as an error."""
        proto = outbox.proto
        log.error("connection %s: writing a step raised; it is closed and its %d requests cancelled",
                  peer_name(proto), len(outbox.streams), exc_info=exc)
        for request_id in list(outbox.streams.values()):
            ex = self.exchanges.get(request_id) or self._group_member(request_id)
            if ex is not None:
                self._drop(ex)
                self.metrics.count_request("error")
                self.access_log.request(proto, ex.method, ex.path, 500, request_id=ex.response_id)
        outbox.streams.clear()
        outbox.sends.clear()
        proto.transport.abort()

    def _drop(self, ex: Exchange) -> None:
        """Write nothing more for `ex`'s request (every choice of it) and cancel it in the engine."""
        for member in (ex,) if ex.group is None else ex.group.members:
            if self.exchanges.pop(member.request_id, None) is not None:
                if member.deadline_timer is not None:
                    member.deadline_timer.cancel()
                self.engine.cancel(member.request_id)

    # ------------------------------------------------------------ cancellation

    def cancel(self, proto, stream_id: int) -> None:
        request_id = proto.outbox.streams.pop(stream_id, None)
        ex = self.exchanges.get(request_id) if request_id is not None else None
        if ex is None and request_id is not None:
            ex = self._group_member(request_id)
        if ex is None:
            return
        self._drop(ex)
        self.metrics.count_request("cancelled")
        self.access_log.request(proto, ex.method, ex.path, 499, request_id=ex.response_id,
                                finish="cancelled by the client")

    def _group_member(self, first_id: int):
        """n > 1 whose first choice already ended: a choice still running, or None."""
        for ex in self.exchanges.values():
            if ex.group is not None and ex.group.members[0].request_id == first_id:
                return ex
        return None

    def cancel_all(self, proto) -> None:
        for stream_id in list(proto.outbox.streams):
            self.cancel(proto, stream_id)

    def drain_step_times(self) -> None:
        self.metrics.step.observe_drained_ns(self.step_times_ns)


def _id_field(ex: Exchange) -> tuple:
    """The response's x-request-id field (its response id: the body's "id"), once per response."""
    return ((b"x-request-id", ex.response_id.encode()),)
