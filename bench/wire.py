"""What the load generator's clients share: one record per stream, and the message counters.

A "message" is one streamed unit the server wrote for one token: an SSE event, an NDJSON
line, a binary int32 token id, a gRPC length-prefixed message. Counters look at DATA
payloads in place (a buffer and a [start, end) range), never copy them, and keep what they
need between payloads in the stream record, since a message may span frames or chunks.
They run once per received frame (hot path), so each is a few bytes-level calls.

What closes a stream is not a token and is not counted: SSE's `data: [DONE]` and a finish
or usage chunk with no text, NDJSON's summary line, the binary end marker and summary.
"""

import time
from typing import Callable, Optional

import orjson

now_ns = time.perf_counter_ns


class StreamRecord:
    """One request's clock and counts, filled by a client connection."""
    __slots__ = ("start_ns", "end_ns", "token_ns", "status", "error", "num_bytes", "refill_at", "left", "head",
                 "timings", "done")

    def __init__(self, start_ns: int):
        self.start_ns = start_ns        # request handed to the transport (perf_counter_ns)
        self.end_ns = 0                 # the stream ended (set by the load runner's callback)
        self.token_ns = []              # arrival time of each complete message, one per token
        self.status = 0                 # HTTP status (gRPC: 200 when grpc-status was 0)
        self.error = None               # why the stream failed, None when it succeeded
        self.num_bytes = 0              # response body bytes
        self.refill_at = 2**30          # HTTP/2: body bytes at which the stream window is handed back
        self.left = 0                   # gRPC: bytes of the message to come; binary: 1 past the end; SSE: see count_sse
        self.head = b""                 # bytes of a message cut by a payload boundary (SSE, NDJSON, binary, gRPC)
        self.timings = None             # the server's own stage timings (µs) when its stream reports them
        self.done = None                # completion callback, set by the client

    @property
    def num_tokens(self) -> int:
        return len(self.token_ns)


# count(rec, buf, start, end) -> messages completed by buf[start:end]
Counter = Callable[[StreamRecord, bytes, int, int], int]

SSE_DONE = b"[DONE]\n\n"
NDJSON_SUMMARY = b'{"finish_reason"'
BINARY_END = b"\xff\xff\xff\xff"


def count_sse(rec: StreamRecord, buf: bytes, start: int, end: int) -> int:
    """SSE events (blank-line terminated) that carry a token (hot path: per frame)."""
    if rec.head:
        return _count_sse_joined(rec, buf[start:end])
    n = buf.count(b"\n\n", start, end)
    if end - start >= 2 and buf[end - 1] == 10 and buf[end - 2] == 10:
        if buf[end - 3] == 93 and buf.endswith(SSE_DONE, start, end):  # 93: "]"
            n -= 1 + non_token_events(rec, buf[start:end])
    else:
        rec.head, rec.left = buf[start:end], n
    return n


def _count_sse_joined(rec: StreamRecord, payload: bytes) -> int:
    """Payloads since the last one that ended between events, joined (rare: frames cut events).

    `rec.head` holds them and `rec.left` how many events of them were already counted; when
    [DONE] arrives its closing events are classified over the whole join, and any already
    counted as tokens are taken back (their timestamps dropped).
    """
    joined = rec.head + payload
    n = joined.count(b"\n\n") - rec.left
    if joined.endswith(SSE_DONE):
        n -= 1 + non_token_events(rec, joined)
    if joined.endswith(b"\n\n"):
        rec.head, rec.left = b"", 0
    else:
        rec.head, rec.left = joined, rec.left + n
    if n < 0:
        del rec.token_ns[n:]
        return 0
    return n


def non_token_events(rec: StreamRecord, payload: bytes) -> int:
    """Events that close a stream without a token: a finish chunk with empty text, a usage chunk.

    Servers write them together with [DONE] (tokenwire does), so only the payload holding
    [DONE] is parsed (once per stream); such an event in an earlier payload stays counted,
    which the load report shows as a token-count mismatch. A server's stage `timings`
    (tokenwire puts them in its last chunk) are kept in the record.
    """
    n = 0
    for event in payload.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(chunk.get("timings"), dict):
            rec.timings = chunk["timings"]
        choices = chunk.get("choices")
        if not choices:
            n += 1
            continue
        choice = choices[0]
        text = choice.get("text", (choice.get("delta") or {}).get("content"))
        n += choice.get("finish_reason") is not None and not text
    return n


def count_ndjson(rec: StreamRecord, buf: bytes, start: int, end: int) -> int:
    """Newline-terminated JSON token lines, without the closing summary line (hot path: per frame).

    The summary is the line starting `{"finish_reason"`; it ends in "}}", which token lines
    (ending in a JSON string and "}") never do. A line cut by a payload boundary is kept
    in `rec.head` as with SSE.
    """
    if rec.head:
        return _count_ndjson_joined(rec, buf[start:end])
    n = buf.count(b"\n", start, end)
    if buf[end - 1] == 10:
        if end - start >= 3 and buf[end - 2] == 125 and buf[end - 3] == 125:  # 125: "}"
            n -= _ends_with_summary(rec, buf, start, end)
    else:
        rec.head, rec.left = buf[start:end], n
    return n


def _count_ndjson_joined(rec: StreamRecord, payload: bytes) -> int:
    joined = rec.head + payload
    n = joined.count(b"\n") - rec.left
    if joined.endswith(b"\n"):
        n -= _ends_with_summary(rec, joined, 0, len(joined))
        rec.head, rec.left = b"", 0
    else:
        rec.head, rec.left = joined, rec.left + n
    return n


def _ends_with_summary(rec: StreamRecord, buf: bytes, start: int, end: int) -> bool:
    """The last line is the summary (once per stream: its timings are kept)."""
    line_start = buf.rfind(b"\n", start, end - 1) + 1 or start
    if not buf.startswith(NDJSON_SUMMARY, line_start, end):
        return False
    try:
        timings = orjson.loads(buf[line_start:end]).get("timings")
    except orjson.JSONDecodeError:
        return True
    if isinstance(timings, dict):
        rec.timings = timings
    return True


def count_binary(rec: StreamRecord, buf: bytes, start: int, end: int) -> int:
    """tokenwire's binary stream: int32 token ids, then the -1 end marker and a summary (hot path).

    Token ids are non-negative, so four 0xff bytes in a row occur first at the marker.
    """
    if rec.left:
        return 0                        # the summary after the end marker
    if rec.head:
        return _count_binary_joined(rec, buf[start:end])
    i = buf.find(BINARY_END, start, end)
    if i >= 0:
        rec.left = 1
        return (i - start) // 4
    rem = (end - start) % 4
    if rem:
        rec.head = buf[end - rem:end]
    return (end - start) // 4


def _count_binary_joined(rec: StreamRecord, payload: bytes) -> int:
    """The last payload cut a 4-byte word (rare)."""
    joined, rec.head = rec.head + payload, b""
    i = joined.find(BINARY_END)
    if i >= 0:
        rec.left = 1
        return i // 4
    rem = len(joined) % 4
    if rem:
        rec.head = joined[-rem:]
    return len(joined) // 4


def count_grpc(rec: StreamRecord, buf: bytes, start: int, end: int) -> int:
    """gRPC messages: 1-byte flag, 4-byte big-endian length, body (hot path: per frame)."""
    n = 0
    pos = start
    while pos < end:
        if rec.left:
            take = min(rec.left, end - pos)
            rec.left -= take
            pos += take
            n += rec.left == 0
            continue
        if rec.head or end - pos < 5:
            take = min(5 - len(rec.head), end - pos)
            rec.head += buf[pos:pos + take]
            pos += take
            if len(rec.head) < 5:
                break
            length = int.from_bytes(rec.head[1:5], "big")
            rec.head = b""
        else:
            length = int.from_bytes(buf[pos + 1:pos + 5], "big")
            pos += 5
        if length == 0:
            n += 1
        rec.left = length
    return n


def count_sse_events(marker: bytes) -> Counter:
    """A counter for typed SSE event streams (OpenAI Responses, Anthropic Messages): the
    events whose bytes hold `marker` (the token's delta event type), counted once complete;
    the start, the closing events and the summary carry other types. An event cut by a
    payload boundary waits in `rec.head` (hot path: per frame)."""
    def count(rec: StreamRecord, buf: bytes, start: int, end: int) -> int:
        if not rec.head and end - start >= 2 and buf[end - 1] == 10 and buf[end - 2] == 10:
            return buf.count(marker, start, end)
        joined = rec.head + buf[start:end]
        cut = joined.rfind(b"\n\n")
        cut = cut + 2 if cut >= 0 else 0       # the end of the last complete event (0: none yet)
        rec.head = joined[cut:]
        return joined.count(marker, 0, cut)
    return count


COUNTERS = {"sse": count_sse, "ndjson": count_ndjson, "binary": count_binary, "grpc": count_grpc,
            "responses": count_sse_events(b'event: response.output_text.delta\n'),
            "messages": count_sse_events(b'event: content_block_delta\n')}


def counter_for(framing: str) -> Counter:
    try:
        return COUNTERS[framing]
    except KeyError:
        raise ValueError(f"unknown stream framing {framing!r}; known: {sorted(COUNTERS)}") from None


def failed(rec: StreamRecord, why: str) -> Optional[StreamRecord]:
    """Mark a stream failed (first reason wins) and complete it."""
    if rec.error is None:
        rec.error = why
    if rec.done is not None:
        done, rec.done = rec.done, None
        done(rec)
    return rec
