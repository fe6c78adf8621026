"""Peers (b) and (c): an OpenAI-style /v1/completions stream in FastAPI, served by hypercorn
(HTTP/2, h2c prior knowledge) or uvicorn (HTTP/1.1).

Written the way FastAPI's documentation shows streaming: a pydantic model validates the
body, and a `StreamingResponse` wraps an async generator that yields one SSE event per
token (`data: {json}\\n\\n`, then `data: [DONE]`), the same chunks tokenwire's completions
route writes. Both servers run on uvloop, as tokenwire does, with access logs off.

Run: python -m tokenwire.bench.peers.fastapi_app --server hypercorn|uvicorn --port P [--step-us N]
"""

import argparse
import json
import sys
import time
import uuid
from typing import Union

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from .mock_source import MockTokens

SERVERS = ("hypercorn", "uvicorn")


class CompletionRequest(BaseModel):
    model: str = "mock"
    prompt: Union[str, list[int]]
    max_tokens: int = 16
    stream: bool = False
    ignore_eos: bool = False


def create_app(step_us: float = 0.0) -> FastAPI:
    app = FastAPI()
    source = MockTokens(step_us)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        async def events():
            async for token in source.stream(request.max_tokens):
                chunk = {"id": completion_id, "object": "text_completion", "created": created,
                         "model": request.model,
                         "choices": [{"index": 0, "text": token.text, "logprobs": None,
                                      "finish_reason": token.finish_reason}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_hypercorn(app: FastAPI, host: str, port: int) -> None:
    import uvloop
    from hypercorn.asyncio import serve
    from hypercorn.config import Config
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    uvloop.run(serve(app, config))


def serve_uvicorn(app: FastAPI, host: str, port: int) -> None:
    import uvicorn
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="auto", access_log=False, log_level="warning")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=SERVERS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-us", type=float, default=0.0, help="mock engine step time (0: zero-cost)")
    args = parser.parse_args(argv)
    app = create_app(args.step_us)
    (serve_hypercorn if args.server == "hypercorn" else serve_uvicorn)(app, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
