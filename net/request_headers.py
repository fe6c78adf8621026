"""Request header blocks as the HTTP/2 session receives them: decoded (HPACK, memoized) and
checked against RFC 7540 8.1.2 in the one pass that also builds the request's header dict.

h2's own inbound header validation is switched off in http2.py: it costs about a third of a
request's receive time, and it turns a malformed request into a connection error, where the
RFC asks for a stream error. `split_headers` raises `MalformedRequest`, and the session
resets just that stream (PROTOCOL_ERROR).
"""

import hpack


class MemoDecoder(hpack.Decoder):
    """hpack's decoder, remembering header blocks that left the dynamic table untouched.

    A block made only of indexed fields and literals without indexing decodes to the same
    list for as long as the dynamic table is the same, and clients that repeat a request
    (load generators, pollers, SDKs with fixed headers) send exactly such blocks. The table's
    state is (number of entries, identity of the newest entry, size limit): every insertion
    puts a new tuple in front and every eviction shortens it, so a cached block is replayed
    only against the table it was decoded with. This saves about a third of h2's receive
    work per request on repeated requests."""

    MAX_ENTRIES = 64

    def __init__(self):
        super().__init__()
        self._memo = {}

    def _state(self, raw: bool) -> tuple:
        table = self.header_table
        entries = table.dynamic_entries
        return len(entries), id(entries[0]) if entries else 0, table.maxsize, self.max_header_list_size, raw

    def decode(self, data, raw: bool = False):
        key = bytes(data)
        state = self._state(raw)
        hit = self._memo.get(key)
        if hit is not None and hit[0] == state:
            return list(hit[1])
        headers = super().decode(data, raw)
        if self._state(raw) == state:
            if len(self._memo) >= self.MAX_ENTRIES:
                self._memo.clear()
            self._memo[key] = (state, headers)
        return headers


class MalformedRequest(ValueError):
    """A request header block RFC 7540 8.1.2 calls malformed."""


# RFC 7230 token characters (lower case only: HTTP/2 field names are lower case)
_NAME_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                 b"upgrade"})
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})


def split_headers(raw) -> tuple[str, str, dict]:
    """h2's decoded header list -> (method, target, {name: value}), checking RFC 7540 8.1.2 in
    the same pass (h2's own inbound validation is off: it costs a third of a request's
    receive time and turns a malformed request into a connection error)."""
    pseudo = {}
    headers = {}
    for name, value in raw:
        if b"\r" in value or b"\n" in value or b"\0" in value:
            raise MalformedRequest(f"illegal character in the value of {name!r}")
        if name[:1] == b":":
            if headers or name not in _REQUEST_PSEUDO or name in pseudo:
                raise MalformedRequest(f"misplaced, unknown or repeated pseudo-header {name!r}")
            pseudo[name] = value
            continue
        if not name or name.translate(None, _NAME_CHARS) or name in _CONNECTION_HEADERS:
            raise MalformedRequest(f"illegal header field name {name!r}")
        if name == b"te" and value != b"trailers":
            raise MalformedRequest("te other than trailers")
        key = name.decode("latin-1")
        val = value.decode("latin-1")
        headers[key] = headers[key] + ", " + val if key in headers else val
    method, path = pseudo.get(b":method"), pseudo.get(b":path")
    if not method or not path or b":scheme" not in pseudo:
        raise MalformedRequest("a request needs :method, :scheme and a non-empty :path")
    if b":authority" in pseudo:
        headers.setdefault("host", pseudo[b":authority"].decode("latin-1"))
    return method.decode("latin-1"), path.decode("latin-1"), headers
