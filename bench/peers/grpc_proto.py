"""mock.proto compiled at run time with grpc_tools.protoc, as protobuf asks ("no checked-in gencode").

protoc runs on a copy laid out as `tokenwire/bench/peers/mock.proto`, so the generated
service module imports `tokenwire.bench.peers.mock_pb2`; both generated files are loaded
under those names from the temporary directory, which is removed right after.
"""

import functools
import importlib.util
import sys
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("mock.proto")
PACKAGE = "tokenwire.bench.peers"
SERVICE_PATH = "/tokenwire.bench.MockGenerator/Generate"


@functools.lru_cache(maxsize=1)
def load():
    """(mock_pb2, mock_pb2_grpc), compiled from mock.proto on first use."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError("the gRPC peer needs grpcio-tools to compile mock.proto: pip install grpcio-tools") from None
    with tempfile.TemporaryDirectory(prefix="tokenwire-proto-") as tmp:
        package_dir = Path(tmp, *PACKAGE.split("."))
        package_dir.mkdir(parents=True)
        (package_dir / PROTO.name).write_bytes(PROTO.read_bytes())
        rel = "/".join([*PACKAGE.split("."), PROTO.name])
        code = protoc.main(["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", rel])
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {PROTO}")
        pb2 = _load_module(f"{PACKAGE}.mock_pb2", package_dir / "mock_pb2.py")
        pb2_grpc = _load_module(f"{PACKAGE}.mock_pb2_grpc", package_dir / "mock_pb2_grpc.py")
    return pb2, pb2_grpc


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the service module imports the messages module by this name
    spec.loader.exec_module(module)
    return module


def request_body(prompt: str, max_tokens: int, model: str = "mock", ignore_eos: bool = True) -> bytes:
    """One GenerateRequest in gRPC framing: flag byte 0, 4-byte length, protobuf bytes."""
    pb2, _ = load()
    message = pb2.GenerateRequest(model=model, prompt=prompt, max_tokens=max_tokens,
                                  ignore_eos=ignore_eos).SerializeToString()
    return b"\x00" + len(message).to_bytes(4, "big") + message
