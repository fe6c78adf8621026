"""`--trace FILE`: per-request stage timelines as Chrome / Perfetto trace JSON.

Written as the JSON Array Format (`[` then one event object per line, each followed by a
comma), streamed as requests finish, so a crash loses nothing already written; both
chrome://tracing and ui.perfetto.dev accept the array without its closing bracket, and
`close()` writes it anyway. Each request is one track (`tid` = request id): complete events
("X") for tokenize, queue, prefill and decode, and an instant event ("i") for every token's
step and for the first token reaching the transport. Times are microseconds on the
monotonic clock.
"""

import orjson

from ..core.outputs import Timeline


class TraceWriter:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "wb")
        self._file.write(b"[\n")
        self._pid = 1

    def add(self, request_id: int, route: str, t: Timeline, end_ns: int, num_cached_tokens: int = 0) -> None:
        """Append one finished request's events (once per request); the "request" span's args
        say how many prompt tokens came from the prefix cache, and whether the whole answer
        came from the response cache."""
        events = []
        tid = request_id

        def span(name, a, b):
            if a and b and b >= a:
                events.append({"name": name, "cat": route, "ph": "X", "ts": a / 1000, "dur": (b - a) / 1000,
                               "pid": self._pid, "tid": tid})

        first_step = t.step_done_ns[0] if t.step_done_ns else 0
        span("tokenize", t.arrived_ns, t.tokenized_ns)
        span("queue", t.queued_ns, t.first_scheduled_ns)
        span("prefill", t.first_scheduled_ns, first_step)
        span("decode", first_step, t.finished_ns or end_ns)
        span("request", t.arrived_ns, end_ns)
        if events and events[-1]["name"] == "request":
            events[-1]["args"] = {"cached_prompt_tokens": num_cached_tokens, "response_cached": t.response_cached}
        for i, ns in enumerate(t.step_done_ns):
            events.append({"name": "token", "ph": "i", "s": "t", "ts": ns / 1000, "pid": self._pid, "tid": tid,
                           "args": {"index": i}})
        if t.first_token_emitted_ns:
            events.append({"name": "first token on the wire", "ph": "i", "s": "t",
                           "ts": t.first_token_emitted_ns / 1000, "pid": self._pid, "tid": tid})
        self._file.write(b"".join(orjson.dumps(e) + b",\n" for e in events))

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.write(orjson.dumps({"name": "process_name", "ph": "M", "pid": self._pid,
                                       "args": {"name": "tokenwire"}}) + b"\n]\n")
        self._file.close()
