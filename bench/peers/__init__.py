"""`tokenwire bench peers` (the command is cli.py): tokenwire against the servers users would otherwise run, on one mock engine.

Servers (each its own process, pinned to one core; the load generator on another):
  tokenwire   `tokenwire serve --backend mock`, HTTP/2 h2c, OpenAI SSE (also: -ndjson, -binary, -h1,
              -grpc: tokenwire.v1.Generator/Generate on the same port)
  hypercorn   FastAPI + hypercorn, HTTP/2 h2c, SSE           (fastapi_app.py)
  uvicorn     FastAPI + uvicorn, HTTP/1.1 chunked, SSE        (fastapi_app.py)
  h2-minimal  one asyncio Protocol over h2, uvloop, HTTP/2 h2c, SSE: the floor for raw h2 in Python (h2_minimal.py)
  grpc        grpc.aio server-streaming RPC                   (grpc_peer.py, mock.proto)
  ceiling     not a peer: canned HTTP/2 responses (bench/canned.py), the most the client can measure
All stream one message per token of the same mock sequence (mock_source.py) at the same
step time. They run one after another under the same closed-loop load from the lean
clients; the 64-byte ping-pong floor is measured first, in the same run.
"""
