"""Peer (e): the floor for raw HTTP/2 in Python — one asyncio Protocol over h2's H2Connection on uvloop.

Written the obvious way, with no framework: h2's sans-IO connection takes every read and
returns events; a request's body is collected until END_STREAM, then a task streams
`POST /v1/completions` as OpenAI SSE, one DATA frame per token (the chunks the FastAPI peers
write, from the same mock source at the same step time), and `data: [DONE]`.

Flow control is honoured both ways, since a real client may open small windows: received
body bytes are handed back with `acknowledge_received_data`, and a chunk larger than the
stream's send window waits for the client's WINDOW_UPDATE and goes out in the pieces the
window allows. Output also waits while the transport is paused (a full socket).

Run: python -m tokenwire.bench.peers.h2_minimal --port P [--step-us N]
"""

import argparse
import asyncio
import sys
import time
import uuid

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import orjson
import uvloop

from .mock_source import MockTokens

PATH = b"/v1/completions"
SSE_HEADERS = [(b":status", b"200"), (b"content-type", b"text/event-stream")]
DONE = b"data: [DONE]\n\n"


class H2Protocol(asyncio.Protocol):
    def __init__(self, source: MockTokens):
        self.source = source
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.requests = {}              # stream id -> (headers, body chunks)
        self.tasks = {}                 # stream id -> the task streaming its response
        self.window_open = {}           # stream id -> future set when a WINDOW_UPDATE may let it send
        self.writable = None            # future set on resume_writing while the transport is paused

    def connection_made(self, transport):
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes):
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.transport.write(self.conn.data_to_send())
            self.transport.close()
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self.requests[event.stream_id] = (dict(event.headers), [])
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.stream_id in self.requests:
                    self.requests[event.stream_id][1].append(event.data)
            elif isinstance(event, h2.events.StreamEnded):
                headers, body = self.requests.pop(event.stream_id)
                self.tasks[event.stream_id] = asyncio.ensure_future(self.respond(event.stream_id, headers, b"".join(body)))
            elif isinstance(event, h2.events.WindowUpdated):
                self.wake(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.requests.pop(event.stream_id, None)
                self.window_open.pop(event.stream_id, None)
                task = self.tasks.pop(event.stream_id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.transport.close()
        self.transport.write(self.conn.data_to_send())

    def connection_lost(self, exc):
        for task in self.tasks.values():
            task.cancel()
        self.wake(0)

    def pause_writing(self):
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self):
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def wake(self, stream_id: int):
        """A WINDOW_UPDATE on the connection (0) may unblock every stream; on a stream, that one."""
        for sid in (list(self.window_open) if stream_id == 0 else [stream_id]):
            future = self.window_open.pop(sid, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def respond(self, stream_id: int, headers: dict, body: bytes):
        try:
            if headers.get(b":method") != b"POST" or headers.get(b":path") != PATH:
                return await self.error(stream_id, 404, f"no route for {headers.get(b':path', b'').decode()}")
            try:
                request = orjson.loads(body)
                prompt, max_tokens = request["prompt"], int(request.get("max_tokens", 16))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                return await self.error(stream_id, 400, "the body must be JSON with a prompt and an integer max_tokens")
            if request.get("stream") is not True or max_tokens < 1 or not isinstance(prompt, (str, list)):
                return await self.error(stream_id, 400, "this server streams only: stream must be true, max_tokens >= 1")
            await self.stream_completion(stream_id, request.get("model", "mock"), max_tokens)
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass                        # the client reset the stream or left while it waited for a window
        finally:
            self.tasks.pop(stream_id, None)

    async def stream_completion(self, stream_id: int, model: str, max_tokens: int):
        self.conn.send_headers(stream_id, SSE_HEADERS)
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        async for token in self.source.stream(max_tokens):
            chunk = {"id": completion_id, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": token.text, "logprobs": None,
                                  "finish_reason": token.finish_reason}]}
            await self.send(stream_id, b"data: " + orjson.dumps(chunk) + b"\n\n")
        await self.send(stream_id, DONE, end_stream=True)

    async def send(self, stream_id: int, data: bytes, end_stream: bool = False):
        """One DATA frame when the windows allow it, else the pieces they allow as they open."""
        while True:
            if self.transport.is_closing():
                raise ConnectionError("the connection closed")
            if self.writable is not None:
                await self.writable
            window = min(self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size)
            if window >= len(data):
                self.conn.send_data(stream_id, data, end_stream=end_stream)
                self.transport.write(self.conn.data_to_send())
                return
            if window > 0:
                self.conn.send_data(stream_id, data[:window])
                self.transport.write(self.conn.data_to_send())
                data = data[window:]
            self.window_open[stream_id] = asyncio.get_running_loop().create_future()
            await self.window_open[stream_id]

    async def error(self, stream_id: int, status: int, message: str):
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})
        self.conn.send_headers(stream_id, [(b":status", str(status).encode()), (b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode())])
        await self.send(stream_id, body, end_stream=True)


async def serve(host: str, port: int, step_us: float):
    source = MockTokens(step_us)
    server = await asyncio.get_running_loop().create_server(lambda: H2Protocol(source), host, port)
    async with server:
        await server.serve_forever()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-us", type=float, default=0.0, help="mock engine step time (0: zero-cost)")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.step_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
