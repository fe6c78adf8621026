"""The per-step hot path: engine outputs become frames on every stream, and exchanges end.

The engine thread calls `on_step_threadsafe` once per step; it hands the step to the loop
(`call_soon_threadsafe`) and waits until the loop has picked it up, so the engine runs at
most one step ahead of the wire. On the loop, `on_step` encodes each output into its
connection's session (one DATA frame per token per stream) and then writes every touched
connection once. An exchange ends with the finish chunk, trailers (`server-timing`) and
its metrics; a reset stream or a lost connection cancels its request in the engine.
"""

import itertools
import threading
import time
from bisect import bisect_left
from collections import deque

from tokenwire.core.outputs import FINISH_CANCELLED, FINISH_ERROR

from . import encoders
from .errors import ApiError
from .metrics import Metrics

JSON = b"application/json"


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
        self._step_taken = threading.Semaphore(0)    # released when the loop picks a step up
        self._touched = []
        self._firsts = []
        self._token_text_cache: dict[int, str] = {}
        self._anchor_id = None

    def add(self, ex: "Exchange") -> None:
        self.exchanges[ex.request_id] = ex
        ex.proto.requests[ex.stream_id] = ex.request_id

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
                    ex.last_ns = now
                    if last:
                        gap = now - last
                        itl_counts[bisect_left(itl_bounds, gap)] += 1
                        itl_sum += gap
                        itl_n += 1
                        ex.send(ex.stream_id, ex.encode(out))
                    else:
                        self._open_stream(ex)
                        ex.send(ex.stream_id, ex.encoder.first_token(out))
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
        if self.step_times_ns:
            self.drain_step_times()

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
