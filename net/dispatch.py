"""The per-step hot path: engine outputs become frames on every stream, and exchanges end.

The engine thread calls `on_step_threadsafe` once per step: it queues the step, rings a
doorbell the loop watches (an eventfd; core/engine_core.Doorbell) and waits on a second
one until the loop has written the step, so the engine runs at most one step ahead of the
wire. Both rings release the GIL (see Doorbell): on a shared core the woken thread runs at
once instead of bouncing off the GIL, two context switches per step instead of ~five. On
the loop, `_on_steps` encodes each output into its connection's session (one DATA frame
per token per stream), writes every touched connection once, then lets the engine go on.
An exchange ends with the finish chunk, trailers (`server-timing`) and its metrics; a
reset stream or a lost connection cancels its request in the engine.

Busy polling: when the last exchange in flight ends, the loop keeps polling its sockets
without blocking (one `call_soon` per pass, so each pass is a zero-timeout epoll) for
`busy_poll_ns`, then blocks as usual. A request arriving in that window is read at once:
a core that blocked goes idle, and waking an idle core (in a VM: the vCPU was descheduled)
costs ~50-100 µs of TTFT at concurrency 1 in this VM. It never polls while a request is in
flight (the engine thread shares the core), and costs at most `busy_poll_ns` of CPU per
burst of traffic; 0 turns it off (`tokenwire serve --busy-poll-us`).
"""

import itertools
import time
from collections import deque

from orjson import dumps

from ..core.engine_core import Doorbell
from ..core.outputs import FINISH_CANCELLED, FINISH_ERROR, RequestOutput, StepTokens

from . import encoders
from .errors import ApiError
from .metrics import Metrics

JSON = b"application/json"


class Exchange:
    """One generation request in flight: where its bytes go and how they are encoded."""
    __slots__ = ("request_id", "proto", "stream_id", "route", "encoder", "streaming", "timeline",
                 "last_ns", "response_id", "created", "texts", "token_ids", "logprobs", "want_logprobs",
                 "send", "encode", "prefix", "suffix", "key", "queue")

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
        whole = not streaming               # whole responses collect their text, ids and logprobs here
        self.texts = [] if whole else None
        self.token_ids = [] if whole else None
        self.logprobs = [] if whole else None
        self.want_logprobs = want_logprobs
        self.send = proto.session.data_writer(stream_id)        # made once: called per token
        self.encode = encoder.token if encoder is not None else None
        # SSE: a later token's chunk is prefix + orjson.dumps(text) + suffix, spliced inline
        self.prefix, self.suffix = encoder.text_parts() if hasattr(encoder, "text_parts") else (None, None)
        self.key = proto.session.data_key(stream_id)            # such chunks wait in proto.sends until
        self.queue = proto.sends.append                         # the end of the step (session.send_batch)


class Dispatcher:
    """Exchanges in flight, keyed by engine request id, and the step hand-off."""

    def __init__(self, metrics: Metrics, trace=None):
        self.engine = None                  # EngineCore (cancel), set by App.attach
        self.model = None                   # app.ModelInfo (name, tokenizer), set by App.attach
        self.loop = None
        self.metrics = metrics
        self.trace = trace                  # trace.TraceWriter or None
        self.exchanges: dict[int, Exchange] = {}
        self.step_times_ns = deque()        # filled by the engine thread (TimedExecutor), drained here
        self.detached = False
        self._steps = deque()               # steps handed over by the engine thread, oldest first
        self._step_ready = None             # Doorbell: the engine rang, a step waits (watched by the loop)
        self._step_taken = None             # Doorbell: the loop wrote the step, the engine may go on
        self._engine_waits = False          # a step was taken from _steps and the engine waits for its ring
        self._touched = []
        self._firsts = []
        self._token_text_cache: dict[int, str] = {}
        self._anchor_id = None
        self.busy_poll_ns = 0               # poll this long after the last exchange ends (see the module docstring)
        self._poll_until = 0
        self._polling = False

    def add(self, ex: "Exchange") -> None:
        self.exchanges[ex.request_id] = ex
        ex.proto.requests[ex.stream_id] = ex.request_id

    def attach(self, engine, model, loop) -> None:
        """Serve `engine`'s steps on `loop` (call on the loop's thread); its steps come as
        StepTokens from now on (`engine.step_columns`)."""
        self.engine, self.model, self.loop = engine, model, loop
        self._step_ready, self._step_taken = Doorbell(), Doorbell()
        loop.add_reader(self._step_ready.fileno(), self._on_steps)
        engine.step_columns = True
        engine.on_step = self.on_step_threadsafe

    def on_step_threadsafe(self, outputs) -> None:
        """Engine thread, once per step: hand the step to the loop, then wait until the loop
        has written it.

        The engine never runs more than one step ahead of the wire: a slow loop makes batches
        bigger instead of letting steps pile up."""
        if self.detached:
            return
        self._steps.append(outputs)
        self._step_ready.ring()
        self._step_taken.wait()

    def detach(self) -> None:
        """The loop is stopping: never block the engine thread again (call on the loop's thread)."""
        if self.detached:
            return
        self.detached = True
        if self._step_ready is not None:
            self.loop.remove_reader(self._step_ready.fileno())
            self._step_taken.ring()

    def close(self) -> None:
        """Release the doorbells, once the engine thread has stopped."""
        for bell in (self._step_ready, self._step_taken):
            if bell is not None:
                bell.close()

    def _on_steps(self) -> None:
        """Loop side of the hand-off: write the waiting step, then let the engine thread go on.

        The engine is let go last: it needs the GIL for its next step anyway, and its step
        then runs while this thread would only be returning to the event loop."""
        self._step_ready.wait()
        try:
            self.dispatch_pending()
        finally:
            self.release_engine()

    def dispatch_pending(self) -> None:
        """Write the step the engine has handed over, if any; the engine waits for
        `release_engine` (App.on_events writes it before new requests, and lets the engine
        go only after them, so its next step takes those requests). Call `release_engine`
        after this, also when it raised."""
        steps = self._steps
        while steps:
            self._engine_waits = True
            self._dispatch_step(steps.popleft())

    def release_engine(self) -> None:
        if self._engine_waits:
            self._engine_waits = False
            self._step_taken.ring()

    def _dispatch_step(self, step) -> None:
        """Write one engine step's outputs to every stream (hot path: once per step).

        Frames for all streams of a connection are gathered in its session and leave in
        one transport write per connection. An SSE token chunk is spliced inline from the
        encoder's `text_parts()` and waits in `proto.sends` until the loop is done; each
        connection's then become DATA frames in one `session.send_batch` pass (same frames
        and windows as one `send_data` each). A stream's finish chunk follows its token at
        once, so that token goes the general way, in order. The inter-token histogram is fed once per run
        of streams whose previous token went out at the same moment (usually the whole
        step: they were all in the previous one), not once per token.

        `step`: a list of RequestOutputs, or the engine's StepTokens (core/outputs.py): its
        columns are the hot path, a later token of an SSE stream; their other entries (a
        stream's first token, other encoders, whole responses) join its rows as RequestOutputs.
        """
        now = time.monotonic_ns()
        exchanges = self.exchanges
        touched = self._touched
        itl = self.metrics.itl
        run_last = run_len = num_tokens = 0
        if type(step) is StepTokens:
            outputs, step_done_ns = step.rows, step.step_done_ns
            if step.request_ids:
                run_last, run_len, num_tokens = self._dispatch_columns(step, now, outputs)
        else:
            outputs = step
            step_done_ns = outputs[0].step_done_ns if outputs else 0
        for out in outputs:
            ex = exchanges.get(out.request_id)
            if ex is None:
                continue            # cancelled: the client is gone
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
                            ex.queue((ex.key, prefix + dumps(out.text) + ex.suffix))
                        else:               # the finish chunk follows at once: this one goes first
                            ex.send(ex.encode(out))
                    else:
                        self._open_stream(ex)
                        ex.send(ex.encoder.first_token(out))
                else:
                    self._collect(ex, out)
            if finish is not None:
                self._finish(ex, out, now)
            proto = ex.proto
            if not proto.dirty:
                proto.dirty = True
                touched.append(proto)
        for proto in touched:
            proto.dirty = False
            sends = proto.sends
            if sends:
                proto.session.send_batch(sends)
                sends.clear()
            proto.flush()
        touched.clear()
        if run_len:
            itl.observe_many_ns(now - run_last, run_len)
        if num_tokens:
            wire_ns = time.monotonic_ns()
            self.metrics.engine_to_wire.observe_many_ns(wire_ns - step_done_ns, num_tokens)
            self.metrics.streamed_tokens += num_tokens
            if self._firsts:
                self._stamp_first_tokens(wire_ns)
        if self.step_times_ns:
            self.drain_step_times()

    def _dispatch_columns(self, step: StepTokens, now: int, rows: list) -> tuple:
        """The columns of a StepTokens: one token each for requests that go on (hot path:
        once per token). A later token of an SSE stream is spliced and queued here; any
        other entry is appended to `rows` as a RequestOutput for the general loop (its
        token counts are never read: it does not finish). -> (run_last, run_len, num_tokens)
        of the inter-token bookkeeping in `_dispatch_step`."""
        get = self.exchanges.get
        touched = self._touched
        itl = self.metrics.itl
        run_last = run_len = num_tokens = 0
        for request_id, token_id, text in zip(step.request_ids, step.token_ids, step.texts):
            ex = get(request_id)
            if ex is None:
                continue            # cancelled: the client is gone
            last = ex.last_ns
            prefix = ex.prefix
            if not last or prefix is None:
                rows.append(RequestOutput(request_id, (token_id,), text, None, None, 0, 0, step.step_done_ns))
                continue
            num_tokens += 1
            ex.last_ns = now
            if last != run_last:
                if run_len:
                    itl.observe_many_ns(now - run_last, run_len)
                run_last, run_len = last, 0
            run_len += 1
            ex.queue((ex.key, prefix + dumps(text) + ex.suffix))
            proto = ex.proto
            if not proto.dirty:
                proto.dirty = True
                touched.append(proto)
        return run_last, run_len, num_tokens

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
        if not self.exchanges and self.busy_poll_ns:
            self._start_polling(now)
        ex.proto.requests.pop(ex.stream_id, None)
        reason = out.finish_reason
        if reason == FINISH_CANCELLED:
            return
        timings = encoders.timings_us(ex.timeline, now)
        use = encoders.usage(out.num_prompt_tokens, out.num_output_tokens)
        trailers = [(b"server-timing", encoders.server_timing(timings))]
        error = out.error if reason == FINISH_ERROR else None
        if ex.streaming and (ex.last_ns or error is None):
            if not ex.last_ns:
                self._open_stream(ex)
            session = ex.proto.session
            session.send_data(ex.stream_id, ex.encoder.finish(out, reason, use, timings, error))
            session.end_response(ex.stream_id, trailers)
        else:               # a whole response, or a stream that failed before its first token: a 500
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

    def _start_polling(self, now: int) -> None:
        self._poll_until = now + self.busy_poll_ns
        if not self._polling:
            self._polling = True
            self.loop.call_soon(self._poll)

    def _poll(self) -> None:
        """One busy-polling pass: scheduled again until a request is in flight or time is up."""
        if self.exchanges or self.detached or time.monotonic_ns() >= self._poll_until:
            self._polling = False
            return
        self.loop.call_soon(self._poll)

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

    # ------------------------------------------------------------ cancellation

    def cancel(self, proto, stream_id: int) -> None:
        request_id = proto.requests.pop(stream_id, None)
        if request_id is not None and self.exchanges.pop(request_id, None) is not None:
            self.engine.cancel(request_id)
            self.metrics.count_request("cancelled")

    def cancel_all(self, proto) -> None:
        for stream_id in list(proto.requests):
            self.cancel(proto, stream_id)

    def drain_step_times(self) -> None:
        times = self.step_times_ns
        step = self.metrics.step
        while times:
            step.observe_ns(times.popleft())
