"""Response body encoders: OpenAI SSE, native NDJSON, native binary; and stage timings.

Each streamed request gets one encoder whose constant bytes (SSE `data: ` prefix with id,
model and created; the per-chunk suffix) are formatted once when the request starts, so
the per-token work is orjson on the token's text and two concatenations. Whole
(non-streamed) OpenAI responses are built here too (`chat_body`, `completion_body`), for the
rows of net/api/openai.py.

SSE (OpenAI): `data: {json}\n\n` per chunk, then `data: [DONE]\n\n`. The last JSON chunk
(the finish chunk, or the usage chunk with `stream_options.include_usage`) also carries
`"timings"`: the request's stage durations in microseconds. With
`stream_options.continuous_usage_stats` every chunk carries the usage so far (those chunks
are then built here, never spliced by the dispatcher). gRPC's Generate encoder lives in
net/api/grpc.py and shares the streamed encoders' interface (`_Stream`).

NDJSON (`POST /generate`, the default): one line per token `{"id": 123, "text": "..."}`,
then one final line `{"finish_reason": ..., "usage": {...}, "timings": {...}}` (plus
`"error"` when the engine failed the request).

Binary (`POST /generate` with `Accept: application/octet-stream`), all little-endian:
    per token:  int32 token id (>= 0)
    at the end: int32 -1, uint32 N, then N bytes of UTF-8 JSON: the NDJSON final object.
A reader loops: read 4 bytes; a non-negative value is a token id; -1 means read the
length and the summary, and the stream is over.
"""

import itertools
import struct
from typing import Callable

import orjson

from ...core.outputs import Timeline

SSE_DONE = b"data: [DONE]\n\n"
END_MARKER = struct.pack("<i", -1)
_LEN = struct.Struct("<I")
_TOKEN_STRUCTS = {n: struct.Struct(f"<{n}i") for n in range(1, 9)}


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    """OpenAI's usage record; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output,
            "total_tokens": num_prompt + num_output, "prompt_tokens_details": {"cached_tokens": num_cached}}


TIMING_NAMES = ("tokenize", "queue", "prefill", "first_token_to_wire", "ttft", "decode", "total")
_SERVER_TIMING = ", ".join(f"{name};dur=%.3f" for name in TIMING_NAMES).encode()


def timings_us(t: Timeline, end_ns: int) -> dict:
    """The request's stages in microseconds, to 0.1 µs (truncated; 0 where a stage was not
    reached). Once per request; the keys are TIMING_NAMES + "_us", in that order
    (server_timing relies on it). One expression per stage, no helper calls (`round` with
    digits costs ~0.3 µs a call): this runs for every request."""
    arrived, tokenized, queued, scheduled = t.arrived_ns, t.tokenized_ns, t.queued_ns, t.first_scheduled_ns
    emitted, steps = t.first_token_emitted_ns, t.step_done_ns
    first = steps[0] if steps else 0
    end = t.finished_ns or end_ns
    return {"tokenize_us": (tokenized - arrived) // 100 / 10 if arrived and tokenized else 0.0,
            "queue_us": (scheduled - queued) // 100 / 10 if queued and scheduled else 0.0,
            "prefill_us": (first - scheduled) // 100 / 10 if scheduled and first else 0.0,
            "first_token_to_wire_us": (emitted - first) // 100 / 10 if first and emitted else 0.0,
            "ttft_us": (emitted - arrived) // 100 / 10 if arrived and emitted else 0.0,
            "decode_us": (end - first) // 100 / 10 if first and end else 0.0,
            "total_us": (end_ns - arrived) // 100 / 10 if arrived and end_ns else 0.0}


def grammar_timings_us(t: Timeline, num_output: int) -> dict:
    """A constrained request's grammar costs: compiling it (0 when it was cached) and filling
    its token masks, per generated token."""
    return {"grammar_compile_us": round(t.grammar_compile_ns / 1000, 1),
            "mask_us_per_token": round(t.mask_ns / 1000 / max(1, num_output), 2)}


def spec_counts(t: Timeline) -> dict:
    """A request that speculated: tokens proposed for it, and of those accepted (core/speculative.py)."""
    return {"spec_proposed": t.spec_proposed, "spec_accepted": t.spec_accepted}


def spec_trailers(t: Timeline) -> list:
    return [(b"tokenwire-spec-proposed", b"%d" % t.spec_proposed),
            (b"tokenwire-spec-accepted", b"%d" % t.spec_accepted)]


def server_timing(timings: dict) -> bytes:
    """`Server-Timing` value (durations in milliseconds, as the header's spec wants)."""
    return _SERVER_TIMING % tuple([us / 1000 for us in timings.values()])


class _Stream:
    """What every streamed encoder shares: the HTTP routes end a stream with their finish
    chunk; an engine error before the first token becomes a 500 (gRPC's encoder overrides both)."""
    __slots__ = ()
    in_band_errors = False

    def trailers(self, base: list, finish_reason: str, error: str | None) -> list:
        return base


# ------------------------------------------------------------------- SSE

def _tails(lp_mid: bytes, usage_tail: bytes) -> tuple:
    """(tail after logprobs, tail of a chunk without logprobs): the same bytes for every request."""
    tail = b',"finish_reason":null}]' + usage_tail + b"}\n\n"
    return tail, lp_mid + b"null" + tail


# include_usage -> (completion tails, chat tails)
_TAILS = {usage: (_tails(b',"logprobs":', b',"usage":null' if usage else b""),
                  _tails(b'},"logprobs":', b',"usage":null' if usage else b""))
          for usage in (False, True)}


class _Sse(_Stream):
    content_type = b"text/event-stream"
    response_headers = ((b"content-type", content_type), (b"cache-control", b"no-cache"))
    __slots__ = ("_prefix", "_first_prefix", "_null_tail", "_lp_mid", "_tail", "_fields", "_include_usage",
                 "_token_text", "_offset", "_started", "_head", "_index", "_num_prompt", "_num_output")

    def __init__(self, fields: dict, include_usage: bool, token_text: Callable[[int], str], index: int,
                 continuous_usage_prompt: int | None = None):
        self._fields = fields                   # id, object, created, model: the head of every chunk
        self._index = index                     # the choice's index (n > 1: net/writer/choices.py)
        self._include_usage = include_usage
        self._token_text = token_text
        self._offset = 0                        # text offset (completions logprobs)
        self._started = False                   # a token chunk went out
        # stream_options.continuous_usage_stats: the prompt's token count (None: off), and the
        # tokens sent so far; every chunk then carries usage, so none is spliced by the dispatcher
        self._num_prompt = continuous_usage_prompt
        self._num_output = 0

    def first_token(self, out) -> bytes:
        """The stream's first chunk (chat: it also carries the role)."""
        self._started = True
        if self._num_prompt is not None:
            return self._with_usage(self._chunk_bytes(self._first_prefix, out), out)
        return self._chunk_bytes(self._first_prefix, out)

    def text_parts(self) -> tuple:
        """(prefix, suffix): a later token's chunk without logprobs is prefix + orjson.dumps(text)
        + suffix, the bytes `token` makes; the dispatcher splices it inline (hot path).
        (None, None) when every chunk carries its own usage."""
        if self._num_prompt is not None:
            return None, None
        return self._prefix, self._null_tail

    def token(self, out) -> bytes:
        """Every later chunk (hot path: once per token)."""
        if self._num_prompt is not None:
            return self._with_usage(self._chunk_bytes(self._prefix, out), out)
        if out.logprobs is None:
            return self._prefix + orjson.dumps(out.text) + self._null_tail
        return self._chunk_bytes(self._prefix, out)

    def _chunk_bytes(self, prefix: bytes, out) -> bytes:
        if out.logprobs is None:
            return prefix + orjson.dumps(out.text) + self._null_tail
        lp = orjson.dumps(self._logprobs(out))
        return prefix + orjson.dumps(out.text) + self._lp_mid + lp + self._tail

    def _with_usage(self, chunk: bytes, out) -> bytes:
        """`chunk` (ending in `}\n\n`, or `"usage":null}\n\n`) with the usage so far."""
        self._num_output += len(out.token_ids)
        use = orjson.dumps(usage(self._num_prompt, self._num_output))
        if self._include_usage:
            return chunk[:-7] + use + b"}\n\n"        # replaces `null}\n\n`
        return chunk[:-3] + b',"usage":' + use + b"}\n\n"

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        """The finish chunk, the usage chunk if asked for, and [DONE] (once per request: the
        common case, no usage chunk and no error, is spliced from bytes, the same bytes
        orjson makes of the whole chunk)."""
        if error is None and not self._include_usage and self._num_prompt is None:
            return (self._head + self._finish_choice() + orjson.dumps(finish_reason) + b'}],"timings":'
                    + orjson.dumps(timings) + b"}\n\n" + SSE_DONE)
        chunk = self._finish_chunk(finish_reason)
        if self._num_prompt is not None:
            chunk["usage"] = use
        if error is not None:
            chunk["error"] = {"message": error, "type": "server_error", "param": None, "code": "engine_error"}
        if self._include_usage:
            chunk.setdefault("usage", None)
            last = self._chunk([])
            last["usage"] = use
            last["timings"] = timings
            parts = (chunk, last)
        else:
            chunk["timings"] = timings
            parts = (chunk,)
        return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in parts) + SSE_DONE

    def finish_choice(self, finish_reason: str) -> bytes:
        """n > 1: this choice's finish chunk alone; the response goes on (net/writer/choices.py)."""
        chunk = self._finish_chunk(finish_reason)
        if self._include_usage:
            chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _chunk(self, choices: list) -> dict:
        return dict(self._fields, choices=choices)


class CompletionSse(_Sse):
    """`text_completion` chunks for POST /v1/completions."""
    __slots__ = ()

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool,
                 token_text: Callable[[int], str], index: int = 0,
                 continuous_usage_prompt: int | None = None):
        fields = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        super().__init__(fields, include_usage, token_text, index, continuous_usage_prompt)
        self._head = head = b"data: " + orjson.dumps(fields)[:-1]
        self._prefix = self._first_prefix = head + b',"choices":[{"index":%d,"text":' % index
        self._lp_mid = b',"logprobs":'
        self._tail, self._null_tail = _TAILS[bool(include_usage)][0]

    def _logprobs(self, out) -> dict:
        text = self._token_text
        tokens = [text(t) for t in out.token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {"tokens": tokens,
                "token_logprobs": [lp.token_logprob for lp in out.logprobs],
                "top_logprobs": [{text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} for lp in out.logprobs],
                "text_offset": offsets}

    def _finish_chunk(self, finish_reason: str) -> dict:
        return self._chunk([{"index": self._index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def _finish_choice(self) -> bytes:
        return b',"choices":[{"index":%d,"text":"","logprobs":null,"finish_reason":' % self._index


class ChatSse(_Sse):
    """`chat.completion.chunk` chunks for POST /v1/chat/completions; the first carries the role."""
    __slots__ = ()

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool,
                 token_text: Callable[[int], str], index: int = 0,
                 continuous_usage_prompt: int | None = None):
        fields = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        super().__init__(fields, include_usage, token_text, index, continuous_usage_prompt)
        self._head = head = b"data: " + orjson.dumps(fields)[:-1]
        start = head + b',"choices":[{"index":%d,"delta":{' % index
        self._prefix = start + b'"content":'
        self._first_prefix = start + b'"role":"assistant","content":'
        self._lp_mid = b'},"logprobs":'
        self._tail, self._null_tail = _TAILS[bool(include_usage)][1]

    def _logprobs(self, out) -> dict:
        return {"content": chat_logprobs(out.token_ids, out.logprobs, self._token_text)}

    def _finish_chunk(self, finish_reason: str) -> dict:
        delta = {} if self._started else {"role": "assistant", "content": ""}
        return self._chunk([{"index": self._index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def _finish_choice(self) -> bytes:
        delta = b"{}" if self._started else b'{"role":"assistant","content":""}'
        return b',"choices":[{"index":%d,"delta":' % self._index + delta + b',"logprobs":null,"finish_reason":'


class ChatToolArgumentsSse(ChatSse):
    """Chat chunks for `tool_choice` naming a function: the generated text is that call's
    arguments, streamed as OpenAI `tool_calls` deltas (the first carries the call's id and
    name), and a completion the grammar ended finishes with "tool_calls"."""
    __slots__ = ()

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool,
                 token_text: Callable[[int], str], call_id: str, name: str):
        super().__init__(request_id, created, model, include_usage, token_text)
        start = self._head + b',"choices":[{"index":0,"delta":{'
        self._prefix = start + b'"tool_calls":[{"index":0,"function":{"arguments":'
        self._first_prefix = (start + b'"role":"assistant","content":null,"tool_calls":[{"index":0,"id":'
                              + orjson.dumps(call_id) + b',"type":"function","function":{"name":'
                              + orjson.dumps(name) + b',"arguments":')
        self._lp_mid = b'}}]},"logprobs":'
        self._null_tail = b"}}]" + self._null_tail

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        return super().finish(out, "tool_calls" if finish_reason == "stop" else finish_reason, use, timings, error)


def chat_logprobs(token_ids, logprobs, token_text: Callable[[int], str]) -> list:
    def entry(tid, value):
        s = token_text(tid)
        return {"token": s, "logprob": value, "bytes": list(s.encode())}
    return [dict(entry(tid, lp.token_logprob),
                 top_logprobs=[entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)])
            for tid, lp in zip(token_ids, logprobs)]


# ------------------------------------------------------------- native

class Ndjson(_Stream):
    """POST /generate, one JSON line per token."""
    content_type = b"application/x-ndjson"
    response_headers = ((b"content-type", content_type), (b"cache-control", b"no-cache"))
    __slots__ = ()

    def token(self, out) -> bytes:
        """Hot path: once per token."""
        ids = out.token_ids
        if len(ids) == 1:
            return b'{"id":' + str(ids[0]).encode() + b',"text":' + orjson.dumps(out.text) + b"}\n"
        lines = [b'{"id":' + str(t).encode() + b',"text":""}\n' for t in ids[:-1]]
        return b"".join(lines) + self.token(out._replace(token_ids=ids[-1:])) if ids else b""

    def first_token(self, out) -> bytes:
        return self.token(out)

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        return orjson.dumps(_summary(finish_reason, use, timings, error)) + b"\n"


class BinaryTokens(_Stream):
    """POST /generate with Accept: application/octet-stream: int32 ids, then -1, length, JSON summary."""
    content_type = b"application/octet-stream"
    response_headers = ((b"content-type", content_type), (b"cache-control", b"no-cache"))
    __slots__ = ()

    def token(self, out) -> bytes:
        """Hot path: once per token."""
        ids = out.token_ids
        n = len(ids)
        if n == 0:
            return b""
        packer = _TOKEN_STRUCTS.get(n) or struct.Struct(f"<{n}i")
        return packer.pack(*ids)

    def first_token(self, out) -> bytes:
        return self.token(out)

    def finish(self, out, finish_reason: str, use: dict, timings: dict, error: str | None = None) -> bytes:
        summary = orjson.dumps(_summary(finish_reason, use, timings, error))
        return END_MARKER + _LEN.pack(len(summary)) + summary


def _summary(finish_reason, use, timings, error) -> dict:
    d = {"finish_reason": finish_reason, "usage": use, "timings": timings}
    if error is not None:
        d["error"] = error
    return d


# ------------------------------------------------------- whole responses

def completion_body(request_id: str, created: int, model: str, text: str, finish_reason: str,
                    use: dict, logprobs: dict | None) -> bytes:
    return orjson.dumps({"id": request_id, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish_reason}],
                         "usage": use})


def chat_body(request_id: str, created: int, model: str, text: str, finish_reason: str,
              use: dict, logprobs: list | None) -> bytes:
    return orjson.dumps({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None if logprobs is None else {"content": logprobs},
                                      "finish_reason": finish_reason}],
                         "usage": use})


def completion_logprobs(token_ids: list, logprobs: list, token_text: Callable[[int], str]) -> dict:
    tokens = [token_text(t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [lp.token_logprob for lp in logprobs],
            "top_logprobs": [{token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} for lp in logprobs],
            "text_offset": offsets}


def choices_body(chat: bool, request_id: str, created: int, model: str, choices: list, use: dict) -> bytes:
    """A whole response with several choices (n > 1, net/writer/choices.py)."""
    kind = "chat.completion" if chat else "text_completion"
    return orjson.dumps({"id": request_id, "object": kind, "created": created, "model": model,
                         "choices": choices, "usage": use})
