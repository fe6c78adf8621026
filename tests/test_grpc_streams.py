"""gRPC calls whose request stream stays open (http2.py rule 11, net/api/grpc.py "Delivery"), with
real clients: grpcio-reflection's bidirectional ServerReflectionInfo (sync and aio, both
reflection packages) holding one stream open across several requests, each answered before
the next is sent, on uvloop and asyncio, over cleartext h2 and TLS; a client that cancels
mid-stream or sends a message over the limit; a raw HTTP/2 client that half-closes a unary
call late, sends it two messages, or cancels it; and the body bytes such calls hold, as the
server-wide budget counts them. Nothing here asserts a duration: each step waits for what
the server said."""

import asyncio
import queue
import tempfile
import threading
import time
from pathlib import Path

import grpc
import grpc.aio
import h2.events
import httpx
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from h2.errors import ErrorCodes

import tokenwire
from tokenwire.net.api import grpc_schema
from tokenwire.net.budgets import MIB, ServerLimits
from tokenwire.net.protocol.events import Limits

from clients.rawh2 import RawH2
from clients.tls import self_signed_cert

MAX_BODY = 64 * 1024
V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
GENERATE = "/tokenwire.v1.Generator/Generate"
CALL_TIMEOUT_S = 30         # only a bound for a server that never answers: no assertion on time


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def loop_kind(request):
    return request.param


@pytest.fixture(scope="module")
def server(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, max_model_len=128,
                         limits=Limits(max_body_bytes=MAX_BODY)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tls_server(loop_kind):
    cert, key = self_signed_cert(Path(tempfile.mkdtemp(prefix="tokenwire-test-tls-")))
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, tls_cert=cert, tls_key=key).start()
    s.cert_pem = Path(cert).read_bytes()
    yield s
    s.stop()


def channel_to(server):
    if getattr(server, "cert_pem", None) is None:
        return grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return grpc.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(server.cert_pem))


def reflection_call(channel, path: str):
    """ServerReflectionInfo: grpcio-reflection's stub for v1alpha, a raw stub for v1 (the same messages)."""
    if path == V1ALPHA:
        return reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
    return channel.stream_stream(path, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)


class Requests:
    """A request iterator fed one request at a time: grpcio sends each as it is put, the
    stream stays open in between, and `half_close` ends it."""

    def __init__(self):
        self.queue = queue.Queue()

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get(timeout=CALL_TIMEOUT_S)
        if item is None:
            raise StopIteration
        return item

    def send(self, request) -> None:
        self.queue.put(request)

    def half_close(self) -> None:
        self.queue.put(None)


def list_services():
    return reflection_pb2.ServerReflectionRequest(list_services="")


def described_file(reply) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(reply.file_descriptor_response.file_descriptor_proto[0])


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


# ------------------------------------------------------------------ reflection on a stream held open

def hold_open_across_three_requests(server, path: str) -> None:
    with channel_to(server) as channel:
        requests = Requests()
        replies = reflection_call(channel, path)(requests, timeout=CALL_TIMEOUT_S)
        requests.send(list_services())          # 1: each request goes out only once the last reply came
        services = {s.name for s in next(replies).list_services_response.service}
        assert {"tokenwire.v1.Generator", "grpc.health.v1.Health", path.split("/")[1]} <= services
        assert replies.is_active()
        requests.send(reflection_pb2.ServerReflectionRequest(file_containing_symbol="tokenwire.v1.Generator"))
        generator = described_file(next(replies))       # 2
        assert "Generator" in [s.name for s in generator.service]
        requests.send(reflection_pb2.ServerReflectionRequest(file_by_filename=generator.name))
        assert described_file(next(replies)) == generator   # 3
        requests.send(reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"))
        missing = next(replies)                 # an unknown symbol is an answer on the stream, not its end
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
        assert replies.is_active()
        requests.half_close()
        assert list(replies) == [] and replies.code() == grpc.StatusCode.OK
    wait_for(lambda: not server.app.grpc.calls)


@pytest.mark.parametrize("path", [V1ALPHA, V1])
def test_reflection_answers_each_request_on_a_stream_held_open(server, path):
    hold_open_across_three_requests(server, path)


def test_reflection_stream_held_open_over_tls(tls_server):
    hold_open_across_three_requests(tls_server, V1ALPHA)


def test_aio_reflection_writes_and_reads_in_turn_then_half_closes(server):
    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=CALL_TIMEOUT_S)
            await call.write(list_services())
            assert (await call.read()).list_services_response.service
            for symbol in ("tokenwire.v1.GenerateRequest", "grpc.health.v1.Health"):
                await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
                reply = await call.read()
                assert reply.original_request.file_containing_symbol == symbol and reply.HasField(
                    "file_descriptor_response")
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
    asyncio.run(main())


def test_a_client_cancelling_mid_stream_ends_the_call_and_the_connection_goes_on(server):
    with channel_to(server) as channel:
        requests = Requests()
        replies = reflection_call(channel, V1ALPHA)(requests, timeout=CALL_TIMEOUT_S)
        requests.send(list_services())
        assert next(replies).list_services_response.service
        assert server.app.grpc.calls                # the call is open on the server
        replies.cancel()                            # RST_STREAM(CANCEL)
        assert replies.code() == grpc.StatusCode.CANCELLED
        wait_for(lambda: not server.app.grpc.calls)
        again = list(reflection_call(channel, V1ALPHA)(iter([list_services()]), timeout=CALL_TIMEOUT_S))
        assert len(again) == 1 and again[0].list_services_response.service


def test_a_message_over_the_limit_mid_stream_is_resource_exhausted(server):
    with channel_to(server) as channel:
        requests = Requests()
        replies = reflection_call(channel, V1ALPHA)(requests, timeout=CALL_TIMEOUT_S)
        requests.send(list_services())
        assert next(replies).list_services_response.service
        requests.send(reflection_pb2.ServerReflectionRequest(host="h" * (MAX_BODY + 1), list_services=""))
        with pytest.raises(grpc.RpcError) as err:
            next(replies)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_BODY) in err.value.details()
        requests.half_close()
        health = channel.unary_unary("/grpc.health.v1.Health/Check")     # the channel is fine
        assert health(b"", timeout=CALL_TIMEOUT_S) == grpc_schema.HealthCheckResponse(status=1).SerializeToString()
    wait_for(lambda: not server.app.grpc.calls)


def test_a_stream_held_open_at_shutdown_ends_unavailable(loop_kind):
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind).start()
    with channel_to(s) as channel:
        requests = Requests()
        replies = reflection_call(channel, V1ALPHA)(requests, timeout=CALL_TIMEOUT_S)
        requests.send(list_services())
        assert next(replies).list_services_response.service
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        with pytest.raises(grpc.RpcError) as err:
            next(replies)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        requests.half_close()
        stopper.join(CALL_TIMEOUT_S)
        assert not stopper.is_alive() and not s.app.connections     # drained, not given up on


# ------------------------------------------------------------------ unary calls, by a raw HTTP/2 client

def open_call(client: RawH2, path: str) -> int:
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                   (":authority", client.host), ("content-type", "application/grpc"),
                                   ("te", "trailers")])
    client.flush()
    return sid


def send_message(client: RawH2, sid: int, payload: bytes, end: bool = False) -> None:
    framed = b"\x00" + len(payload).to_bytes(4, "big") + payload
    for i in range(0, len(framed), 16384):
        client.conn.send_data(sid, framed[i:i + 16384], end_stream=end and i + 16384 >= len(framed))
    client.flush()


def read_everything_sent(client: RawH2) -> None:
    """Until the server acknowledges a PING sent after everything else: it has read it all."""
    client.conn.ping(b"all-read")
    client.flush()
    acked = []
    while not acked:
        acked += [ev for ev in client.read_once() if isinstance(ev, h2.events.PingAckReceived)]


def body_bytes(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=CALL_TIMEOUT_S).text
    return float(text.split("\ntokenwire_body_bytes ", 1)[1].split()[0])


def trailers_of(client: RawH2, sid: int) -> dict:
    return dict(client.trailers[sid])


def generate_message(max_tokens: int) -> bytes:
    return grpc_schema.GenerateRequest(text="Once", max_tokens=max_tokens).SerializeToString()


def test_a_unary_call_waits_for_a_late_half_close_its_message_counted_until_then(server):
    client = RawH2("127.0.0.1", server.port)
    try:
        message = generate_message(4)
        sid = open_call(client, GENERATE)
        send_message(client, sid, message)
        read_everything_sent(client)
        assert sid not in client.status             # no answer before the half-close
        assert body_bytes(server) == len(message)   # the kept message, in the server-wide count
        client.conn.end_stream(sid)
        client.flush()
        client.read_until(lambda: sid in client.ended)
        assert trailers_of(client, sid)[b"grpc-status"] == b"0"
        final = grpc_schema.GenerateResponse.FromString(client.data[sid][-grpc_final_len(client.data[sid]):])
        assert final.final.usage.completion_tokens == 4
        assert body_bytes(server) == 0
    finally:
        client.close()


def grpc_final_len(data: bytes) -> int:
    """The length of the last message's bytes in a response body of framed messages."""
    pos, last = 0, 0
    while pos < len(data):
        last = int.from_bytes(data[pos + 1:pos + 5], "big")
        pos += 5 + last
    return last


def test_a_second_message_to_a_unary_method_is_unimplemented_at_once(server):
    client = RawH2("127.0.0.1", server.port)
    try:
        sid = open_call(client, GENERATE)
        send_message(client, sid, generate_message(3))
        send_message(client, sid, generate_message(3))
        client.read_until(lambda: sid in client.ended)      # without a half-close
        assert trailers_of(client, sid)[b"grpc-status"] == b"12"
        client.read_until(lambda: sid in client.resets)
        assert client.resets[sid] == ErrorCodes.NO_ERROR    # the rest of the request is not wanted
        sid = open_call(client, GENERATE)                   # the connection goes on
        send_message(client, sid, generate_message(2), end=True)
        client.read_until(lambda: sid in client.ended)
        assert trailers_of(client, sid)[b"grpc-status"] == b"0"
        assert body_bytes(server) == 0
    finally:
        client.close()


def test_a_unary_call_cancelled_before_its_half_close_lets_its_message_go(server):
    client = RawH2("127.0.0.1", server.port)
    try:
        sid = open_call(client, GENERATE)
        message = generate_message(3)
        send_message(client, sid, message)
        read_everything_sent(client)
        assert body_bytes(server) == len(message) and server.app.grpc.calls
        client.reset(sid)
        read_everything_sent(client)
        assert body_bytes(server) == 0
        wait_for(lambda: not server.app.grpc.calls)
    finally:
        client.close()


def test_an_incomplete_message_of_an_open_stream_counts_toward_the_server_wide_body_budget(loop_kind):
    """A reflection stream whose next message is 900 KB (under --max-body-bytes), 300 KB of it
    sent: past the 256 KiB budget its connection is ended (GOAWAY ENHANCE_YOUR_CALM)."""
    s = tokenwire.Server(backend="mock", port=0, loop=loop_kind, limits=Limits(max_body_bytes=MIB),
                         server_limits=ServerLimits(max_total_body_bytes=256 * 1024)).start()
    try:
        client = RawH2("127.0.0.1", s.port)
        client.read_once()                                  # the server's SETTINGS: its windows
        sid = open_call(client, V1ALPHA)
        send_message(client, sid, list_services().SerializeToString())
        client.read_until(lambda: sid in client.data)      # answered, the stream still open
        framed = b"\x00" + (900_000).to_bytes(4, "big") + b"x" * 300_000
        for i in range(0, len(framed), 16384):
            client.conn.send_data(sid, framed[i:i + 16384])
        client.flush()
        client.read_until(lambda: client.goaway is not None)
        assert client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
        client.close()
    finally:
        s.stop()
