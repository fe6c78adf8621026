"""The load generator's ceiling: an HTTP/2 server that answers every request with canned bytes.

Per request it writes one prebuilt response — HEADERS (:status 200, HPACK static index),
`--tokens` DATA frames of an SSE chunk shaped like tokenwire's, and `data: [DONE]` with
END_STREAM — in one transport write, so it costs a few µs per request and nothing per
token. Whatever tokens/s the lean client reaches against it is the most it can measure on
this machine; `tokenwire bench peers` runs it as the "ceiling" row.

Minimal on purpose: prior knowledge only, SETTINGS ACKed, a request is recognised by its
HEADERS frame, request bodies are dropped and handed back with connection WINDOW_UPDATEs
(each body fits the default stream window), the client's windows are assumed open (the
lean client opens them to 2**31 - 1 before its first request).

Run: python -m tokenwire.bench.canned --port P [--tokens N]
"""

import argparse
import asyncio
import struct
import sys

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = struct.Struct(">IBI")        # (length << 8 | type), flags, stream id
DATA, HEADERS, SETTINGS, PING, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x8
REFILL_AT = 32768                   # request-body bytes received before the connection window is handed back
CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"canned","choices":'
         b'[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}\n\n')


def response_parts(num_tokens: int) -> list:
    """The response's bytes split where the 4-byte stream id goes (see RequestTemplate.frames)."""
    block = b"\x88" + b"\x10\x0ccontent-type\x11text/event-stream"   # :status 200; never-indexed literal
    parts = [HEAD.pack(len(block) << 8 | HEADERS, 0x4, 0)[:5], block]
    for payload, flags in [(CHUNK, 0)] * num_tokens + [(b"data: [DONE]\n\n", 0x1)]:
        parts[-1] += HEAD.pack(len(payload) << 8 | DATA, flags, 0)[:5]
        parts.append(payload)
    return parts


class CannedProtocol(asyncio.Protocol):
    def __init__(self, parts: list):
        self._parts = parts
        self._buf = b""
        self._preface = False
        self._received = 0              # DATA bytes not yet handed back
    def connection_made(self, transport):
        self.transport = transport
        settings = struct.pack(">HI", 0x3, 100_000)     # MAX_CONCURRENT_STREAMS
        transport.write(HEAD.pack(len(settings) << 8 | SETTINGS, 0, 0) + settings)

    def data_received(self, data: bytes):
        buf = self._buf + data
        pos = 0
        if not self._preface:
            if len(buf) < len(PREFACE):
                self._buf = buf
                return
            pos, self._preface = len(PREFACE), True
        out = []
        while len(buf) - pos >= 9:
            head, flags, stream_id = HEAD.unpack_from(buf, pos)
            end = pos + 9 + (head >> 8)
            if end > len(buf):
                break
            kind = head & 0xFF
            if kind == HEADERS:
                out.append((stream_id & 0x7FFFFFFF).to_bytes(4, "big").join(self._parts))
            elif kind == DATA:
                self._received += head >> 8
            elif kind == SETTINGS and not flags & 0x1:
                out.append(HEAD.pack(SETTINGS, 0x1, 0))
            elif kind == PING and not flags & 0x1:
                out.append(HEAD.pack(8 << 8 | PING, 0x1, 0) + buf[pos + 9:end])
            pos = end
        self._buf = buf[pos:]
        if self._received >= REFILL_AT:
            out.append(HEAD.pack(4 << 8 | WINDOW_UPDATE, 0, 0) + self._received.to_bytes(4, "big"))
            self._received = 0
        if out:
            self.transport.write(b"".join(out))


async def serve(host: str, port: int, num_tokens: int) -> None:
    parts = response_parts(num_tokens)
    server = await asyncio.get_running_loop().create_server(lambda: CannedProtocol(parts), host, port)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=32, help="DATA frames (tokens) per response")
    args = parser.parse_args(argv)
    try:
        import uvloop
        uvloop.run(serve(args.host, args.port, args.tokens))
    except ImportError:
        asyncio.run(serve(args.host, args.port, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
