"""The gRPC schema: the .proto files in net/api/proto/, compiled into one descriptor set.

`net/api/proto/descriptors.binpb` is a serialized `FileDescriptorSet` made by protoc from
tokenwire.proto, health.proto and reflection.proto, laid out under their package paths
(`tokenwire/v1/tokenwire.proto`, ...). At import it is read into a private descriptor pool
(never protobuf's default pool, so a process that also loads grpcio's own health or
reflection modules sees no duplicate files), and the message classes come from it. Server
reflection hands clients the same FileDescriptorProto bytes.

Regenerate after editing a .proto (needs grpcio-tools, a test dependency; a test checks
the committed set matches the .proto files):

    python -m tokenwire.net.api.grpc_schema --regenerate
"""

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO_DIR = Path(__file__).with_name("proto")
DESCRIPTORS = PROTO_DIR / "descriptors.binpb"
# .proto in net/api/proto -> its path in the descriptor set (its package's directories)
LAYOUT = {"tokenwire.proto": "tokenwire/v1/tokenwire.proto",
          "health.proto": "grpc/health/v1/health.proto",
          "reflection.proto": "grpc/reflection/v1alpha/reflection.proto"}


def compile_descriptor_set() -> bytes:
    """protoc over net/api/proto/*.proto -> serialized FileDescriptorSet (needs grpcio-tools)."""
    from grpc_tools import protoc       # optional: only to regenerate, and in the test that checks it
    with tempfile.TemporaryDirectory(prefix="tokenwire-proto-") as tmp:
        for name, rel in LAYOUT.items():
            target = Path(tmp, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((PROTO_DIR / name).read_bytes())
        out = Path(tmp, "set.binpb")
        code = protoc.main(["protoc", f"-I{tmp}", f"--descriptor_set_out={out}", *LAYOUT.values()])
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {PROTO_DIR}")
        return out.read_bytes()


def _load():
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes()).file
    pool = descriptor_pool.DescriptorPool()
    for f in files:
        pool.Add(f)
    return pool, {f.name: f.SerializeToString() for f in files}


POOL, FILE_BYTES = _load()          # FILE_BYTES: file name -> serialized FileDescriptorProto


def message_class(full_name: str):
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


GenerateRequest = message_class("tokenwire.v1.GenerateRequest")
GenerateResponse = message_class("tokenwire.v1.GenerateResponse")
ListModelsResponse = message_class("tokenwire.v1.ListModelsResponse")
HealthCheckRequest = message_class("grpc.health.v1.HealthCheckRequest")
HealthCheckResponse = message_class("grpc.health.v1.HealthCheckResponse")
ReflectionRequest = message_class("grpc.reflection.v1alpha.ServerReflectionRequest")
ReflectionResponse = message_class("grpc.reflection.v1alpha.ServerReflectionResponse")


def file_containing_symbol(symbol: str) -> str | None:
    """The descriptor file that defines `symbol` (a service, method, message or enum), or None."""
    try:
        return POOL.FindFileContainingSymbol(symbol).name
    except KeyError:
        return None


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python -m tokenwire.net.api.grpc_schema --regenerate")
    DESCRIPTORS.write_bytes(compile_descriptor_set())
    print(f"wrote {DESCRIPTORS}")
