"""gRPC on tokenwire's HTTP/2 port, with real clients: grpcio's generated stubs (sync and
aio) streaming, cancelling and timing out; grpcio's health and reflection clients; HTTP/2
and gRPC requests multiplexed on one connection; the hand-encoded token messages against
the protobuf classes; the committed descriptor set against the .proto files."""

import asyncio
import gzip
import importlib.util
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import socket
import struct
import grpc.aio
from grpc_tools import protoc
import httpx
import pytest
from google.protobuf import descriptor_pb2, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool

import tokenwire
from tokenwire.net.api import grpc as tw_grpc
from tokenwire.net.api import grpc_schema

PROTO = Path(tokenwire.net.api.grpc_schema.__file__).with_name("proto") / "tokenwire.proto"
API_KEY = "k3y"


def compile_stubs():
    """tokenwire.proto compiled by grpc_tools into (tokenwire_pb2, tokenwire_pb2_grpc), the way
    a user of the service would."""
    tmp = tempfile.mkdtemp(prefix="tokenwire-test-proto-")
    target = Path(tmp, "tokenwire", "v1", "tokenwire.proto")
    target.parent.mkdir(parents=True)
    target.write_bytes(PROTO.read_bytes())
    assert protoc.main(["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                        "tokenwire/v1/tokenwire.proto"]) == 0
    return _load(tmp, "tokenwire_pb2"), _load(tmp, "tokenwire_pb2_grpc")


def _load(tmp, name):
    # the generated service module does `from tokenwire.v1 import tokenwire_pb2`: give it that name
    path = Path(tmp, "tokenwire", "v1", f"{name}.py")
    full = f"tokenwire.v1.{name}"
    spec = importlib.util.spec_from_file_location(full, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    if "tokenwire.v1" not in sys.modules:
        package = importlib.util.module_from_spec(importlib.util.spec_from_loader("tokenwire.v1", loader=None))
        package.__path__ = [str(path.parent)]
        sys.modules["tokenwire.v1"] = package
    sys.modules["tokenwire.v1"].__dict__[name] = module
    spec.loader.exec_module(module)
    return module


pb2, pb2_grpc = compile_stubs()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def server(request):
    s = tokenwire.Server(backend="mock", port=0, loop=request.param, max_model_len=128, mock_step_us=2000).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def authed():
    s = tokenwire.Server(backend="mock", port=0, api_key=API_KEY).start()
    yield s
    s.stop()


def target(server):
    return f"127.0.0.1:{server.port}"


def running(server) -> int:
    return server.engine.stats().num_running + server.engine.stats().num_waiting


def kv_used(server) -> int:
    return server.engine.stats().num_kv_blocks_used


# ------------------------------------------------------------------ Generate

def test_generate_streams_tokens_then_a_final_message(server):
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        replies = list(stub.Generate(pb2.GenerateRequest(text="Once upon a time", max_tokens=8, temperature=0)))
    final = replies[-1].final
    assert len(replies) == 8 and all(len(r.token_ids) == 1 for r in replies)      # a message per token
    assert not any(r.HasField("final") for r in replies[:-1])
    assert "".join(r.text for r in replies).startswith("Once upon a time")  # the mock's story
    assert final.finish_reason == "length" and final.usage.completion_tokens == 8
    assert final.usage.total_tokens == final.usage.prompt_tokens + 8 and final.timings.total_us > 0
    # token ids as the prompt, stop strings, seed: the same story
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        replies = list(stub.Generate(pb2.GenerateRequest(token_ids=[5, 6, 7], max_tokens=30, stop=["robot"],
                                                         seed=3)))
    assert replies[-1].final.finish_reason == "stop"
    assert "".join(r.text for r in replies).endswith("a little ")


def test_list_models_and_errors(server):
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        models = stub.ListModels(pb2.ListModelsRequest()).models
        assert [m.id for m in models] == ["mock"] and models[0].max_model_len == 128
        cases = [(pb2.GenerateRequest(text="x", max_tokens=1000), grpc.StatusCode.INVALID_ARGUMENT, "1000"),
                 (pb2.GenerateRequest(text="x", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
                 (pb2.GenerateRequest(max_tokens=3), grpc.StatusCode.INVALID_ARGUMENT, "text"),
                 (pb2.GenerateRequest(text="x", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
                 (pb2.GenerateRequest(token_ids=[10**6]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary")]
        for request, code, word in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request))
            assert err.value.code() == code and word in err.value.details()
        unknown = channel.unary_unary("/tokenwire.v1.Generator/Nope")
        with pytest.raises(grpc.RpcError) as err:
            unknown(b"")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_api_key_is_authorization_metadata(authed):
    with grpc.insecure_channel(target(authed)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb2.GenerateRequest(text="x", max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.Generate(pb2.GenerateRequest(text="x", max_tokens=2),
                                     metadata=[("authorization", f"Bearer {API_KEY}")]))
        assert replies[-1].final.usage.completion_tokens == 2
        health = health_pb2_grpc.HealthStub(channel)        # probes need no key
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_cancelling_frees_the_kv_within_a_step(server):
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        call = stub.Generate(pb2.GenerateRequest(text="Once", max_tokens=100))
        next(call)
        assert running(server) == 1 and kv_used(server) > 0
        steps = server.engine.num_steps
        call.cancel()
        wait_for(lambda: kv_used(server) == 0)
        assert server.engine.num_steps - steps <= 3      # the cancel lands at the next step (2 ms each)
        assert running(server) == 0


def test_grpc_timeout_ends_with_deadline_exceeded(server):
    with grpc.insecure_channel(target(server)) as channel:
        stub = pb2_grpc.GeneratorStub(channel)
        start = time.monotonic()
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for reply in stub.Generate(pb2.GenerateRequest(text="Once", max_tokens=120), timeout=0.1):
                got.append(reply)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got and time.monotonic() - start < 1.0
        wait_for(lambda: kv_used(server) == 0 and running(server) == 0)


def raw_grpc(server, path: str, body: bytes, **headers) -> tuple:
    """One gRPC call over a plain h2 connection: -> (response headers, DATA bytes, trailers)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(conn.data_to_send())
        sid = conn.get_next_available_stream_id()
        fields = [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", path),
                  ("content-type", "application/grpc"), ("te", "trailers")] + list(headers.items())
        conn.send_headers(sid, [(k.replace("_", "-"), v) for k, v in fields])
        conn.send_data(sid, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        response, data, trailers = {}, b"", None
        while trailers is None:
            chunk = sock.recv(65536)
            assert chunk, "connection closed"
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    response = dict(ev.headers)
                elif isinstance(ev, h2.events.DataReceived):
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, h2.events.TrailersReceived):
                    trailers = dict(ev.headers)
            sock.sendall(conn.data_to_send())
    return response, data, trailers


def test_server_side_deadline_status(server):
    """A client that sends grpc-timeout but does not enforce it itself (raw HTTP/2) still gets the
    server's DEADLINE_EXCEEDED trailers, after some tokens."""
    body = tw_grpc.frame(pb2.GenerateRequest(text="Once", max_tokens=120).SerializeToString())
    _, data, trailers = raw_grpc(server, "/tokenwire.v1.Generator/Generate", body, grpc_timeout="50m")
    assert trailers[b"grpc-status"] == str(tw_grpc.DEADLINE_EXCEEDED).encode() and len(split(data)) >= 2
    wait_for(lambda: kv_used(server) == 0)


def test_gzip_messages_accepted_and_unknown_encodings_refused(server):
    body = pb2.GenerateRequest(text="Once", max_tokens=3).SerializeToString()
    packed = gzip.compress(body)
    path = "/tokenwire.v1.Generator/Generate"
    _, data, trailers = raw_grpc(server, path, b"\x01" + len(packed).to_bytes(4, "big") + packed,
                                 grpc_encoding="gzip")
    assert trailers[b"grpc-status"] == b"0"
    assert pb2.GenerateResponse.FromString(split(data)[-1]).final.usage.completion_tokens == 3
    headers, _, trailers = raw_grpc(server, path, tw_grpc.frame(body), grpc_encoding="br")
    assert trailers[b"grpc-status"] == str(tw_grpc.UNIMPLEMENTED).encode()
    assert b"gzip" in headers[b"grpc-accept-encoding"]
    _, _, trailers = raw_grpc(server, path, b"\x01" + len(packed).to_bytes(4, "big") + packed)
    assert trailers[b"grpc-status"] == str(tw_grpc.INTERNAL).encode()
    with grpc.insecure_channel(target(server), compression=grpc.Compression.Gzip) as channel:
        replies = list(pb2_grpc.GeneratorStub(channel).Generate(pb2.GenerateRequest(text="x", max_tokens=2)))
        assert replies[-1].final.usage.completion_tokens == 2


def split(body: bytes) -> list:
    out, pos = [], 0
    while pos < len(body):
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        out.append(body[pos + 5:pos + 5 + n])
        pos += 5 + n
    return out


def test_aio_stub_streams_cancels_and_times_out(server):
    async def main():
        async with grpc.aio.insecure_channel(target(server)) as channel:
            stub = pb2_grpc.GeneratorStub(channel)
            replies = [r async for r in stub.Generate(pb2.GenerateRequest(text="x", max_tokens=5))]
            assert replies[-1].final.usage.completion_tokens == 5
            many = await asyncio.gather(*[_collect(stub, 4) for _ in range(16)])
            assert all(n == 4 for n in many)
            call = stub.Generate(pb2.GenerateRequest(text="x", max_tokens=100))
            await call.read()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(pb2.GenerateRequest(text="x", max_tokens=100), timeout=0.05):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    asyncio.run(main())
    wait_for(lambda: kv_used(server) == 0 and running(server) == 0)


async def _collect(stub, n):
    replies = [r async for r in stub.Generate(pb2.GenerateRequest(text="x", max_tokens=n))]
    return replies[-1].final.usage.completion_tokens


# ------------------------------------------------------------------ health, reflection

def test_health_check_and_watch(server):
    with grpc.insecure_channel(target(server)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == serving
        assert health.Check(health_pb2.HealthCheckRequest(service="tokenwire.v1.Generator")).status == serving
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == serving
        watch.cancel()


def test_health_watch_sees_not_serving_at_shutdown():
    s = tokenwire.Server(backend="mock", port=0).start()
    channel = grpc.insecure_channel(target(s))
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    stopper.join(10)
    channel.close()


def test_reflection_lists_services_and_describes_generate(server):
    with grpc.insecure_channel(target(server)) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"tokenwire.v1.Generator", "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(db)
        method = pool.FindServiceByName("tokenwire.v1.Generator").FindMethodByName("Generate")
        assert method.output_type.full_name == "tokenwire.v1.GenerateResponse" and method.server_streaming
        # a Generate built only from what reflection returned
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_stream("/tokenwire.v1.Generator/Generate",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        replies = list(call(request_cls(text="Once", max_tokens=4)))
        assert replies[-1].final.usage.completion_tokens == 4


# ------------------------------------------------------------------ one connection, both APIs

def test_http2_and_grpc_multiplexed_on_one_connection(server):
    """httpx sends OpenAI and gRPC requests as concurrent streams of one HTTP/2 connection."""
    body = tw_grpc.frame(pb2.GenerateRequest(text="Once", max_tokens=6).SerializeToString())

    async def main():
        async with httpx.AsyncClient(http1=False, http2=True, base_url=server.url, timeout=10) as client:
            grpc_call = client.post("/tokenwire.v1.Generator/Generate", content=body,
                                    headers={"content-type": "application/grpc", "te": "trailers"})
            sse_call = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 6, "stream": True})
            g, s = await asyncio.gather(grpc_call, sse_call)
            return g, s, client
    g, s, _ = asyncio.run(main())
    assert g.http_version == s.http_version == "HTTP/2"
    messages = split(g.content)
    assert pb2.GenerateResponse.FromString(messages[-1]).final.usage.completion_tokens == 6
    assert s.text.endswith("data: [DONE]\n\n")


# ------------------------------------------------------------------ units

@pytest.mark.parametrize("ids,text", [([5], "hi"), ([300], ""), ([2**20 + 3], "é🙂"), ([1, 2, 3], "abc" * 100), ([], "x")])
def test_hand_encoded_token_message_matches_protobuf(ids, text):
    expected = pb2.GenerateResponse(token_ids=ids, text=text).SerializeToString()
    assert tw_grpc.token_message(ids, text) == tw_grpc.frame(expected)


def test_timeouts_and_framing():
    assert tw_grpc.parse_timeout("100m") == 100_000_000 and tw_grpc.parse_timeout("1H") == 3600 * 10**9
    for bad in ("", "m", "123456789S", "1x", "-1S"):
        with pytest.raises(tw_grpc.GrpcError):
            tw_grpc.parse_timeout(bad)
    assert tw_grpc.split_messages(tw_grpc.frame(b"ab") + tw_grpc.frame(b""), None, 100) == [b"ab", b""]
    with pytest.raises(tw_grpc.GrpcError):
        tw_grpc.split_messages(b"\x00\x00\x00\x00\x05ab", None, 100)


def test_a_gzip_message_is_bounded_by_what_it_inflates_to():
    """A gzip bomb: 1 MiB of zeros is ~1 KB compressed; the body limit holds for the inflated
    message (RESOURCE_EXHAUSTED), read no further than the limit; multi-member gzip is whole;
    a cut-off stream is INTERNAL."""
    limit = 64 * 1024
    exact, bomb = gzip.compress(bytes(limit)), gzip.compress(bytes(1 << 20))
    assert len(bomb) < 2048
    compressed = struct.pack(">BI", 1, len(bomb)) + bomb
    with pytest.raises(tw_grpc.GrpcError) as err:
        tw_grpc.split_messages(compressed, "gzip", limit)
    assert err.value.code == tw_grpc.RESOURCE_EXHAUSTED and "inflates past" in str(err.value)
    assert tw_grpc.split_messages(struct.pack(">BI", 1, len(exact)) + exact, "gzip", limit) == [bytes(limit)]
    two = gzip.compress(b"ab") + gzip.compress(b"cd")
    assert tw_grpc.split_messages(struct.pack(">BI", 1, len(two)) + two, "gzip", limit) == [b"abcd"]
    cut = exact[:-12]
    with pytest.raises(tw_grpc.GrpcError) as err:
        tw_grpc.split_messages(struct.pack(">BI", 1, len(cut)) + cut, "gzip", limit)
    assert err.value.code == tw_grpc.INTERNAL


def test_committed_descriptor_set_matches_the_proto_files():
    committed = descriptor_pb2.FileDescriptorSet.FromString(grpc_schema.DESCRIPTORS.read_bytes())
    fresh = descriptor_pb2.FileDescriptorSet.FromString(grpc_schema.compile_descriptor_set())
    assert committed == fresh, "run: python -m tokenwire.net.api.grpc_schema --regenerate"


# ------------------------------------------------------------------ output constraints

@pytest.fixture(scope="module")
def cpu_server():
    """The default model on the CPU backend: it does constrained decoding (llguidance)."""
    s = tokenwire.Server(backend="cpu", port=0).start()
    yield s
    s.stop()


def _generate(server, **fields) -> tuple:
    """-> (the text, the final message), or raises grpc.RpcError."""
    with grpc.insecure_channel(target(server)) as channel:
        replies = list(pb2_grpc.GeneratorStub(channel).Generate(pb2.GenerateRequest(**fields), timeout=120))
    return "".join(r.text for r in replies), replies[-1].final


def test_generate_output_constraints(cpu_server):
    text, final = _generate(cpu_server, text="Code:", max_tokens=40, regex=r"[0-9]{3}-[a-z]{2}", seed=1)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) and final.finish_reason == "stop", text
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "rain"],
              "properties": {"city": {"enum": ["Paris", "Oslo"]}, "rain": {"type": "boolean"}}}
    text, final = _generate(cpu_server, text="Weather:", max_tokens=60, json_schema=json.dumps(schema), seed=2)
    value = json.loads(text)
    assert set(value) == {"city", "rain"} and value["city"] in ("Paris", "Oslo") and isinstance(value["rain"], bool)
    text, _ = _generate(cpu_server, text="Answer:", max_tokens=10, choice=pb2.Choices(choices=["yes", "no"]), seed=3)
    assert text in ("yes", "no")
    text, _ = _generate(cpu_server, text="Object:", max_tokens=60, json_object=True, seed=4)
    assert isinstance(json.loads(text), dict)
    for k in range(4):              # greedy (the cpu forward's argmax comes before the mask): not INTERNAL
        text, final = _generate(cpu_server, text=f"Request number {k} says", max_tokens=60, json_object=True,
                                temperature=0)
        assert isinstance(json.loads(text), dict) and final.finish_reason == "stop", text
    text, _ = _generate(cpu_server, text="Free:", max_tokens=5, json_object=False, temperature=0)   # no constraint
    assert text


@pytest.mark.parametrize("fields, message", [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON schema object"),
    ({"choice": pb2.Choices(choices=[])}, "choice must be a non-empty array"),
    ({"grammar": "start: nonsense_rule_that_is_not_defined"}, "grammar"),     # compiled off the loop
])
def test_generate_bad_constraints_are_invalid_argument(cpu_server, fields, message):
    with pytest.raises(grpc.RpcError) as exc:
        _generate(cpu_server, text="x", max_tokens=5, **fields)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in exc.value.details()


def test_generate_constraint_on_a_backend_without_grammars_is_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as exc:
        _generate(server, text="x", max_tokens=5, regex="a+")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no constrained decoding" in exc.value.details()
