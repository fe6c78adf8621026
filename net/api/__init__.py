"""The API layer: one module per API family, one row per generation route.

`ROUTES` maps each HTTP generation path to its family's `route.Route` row; net/app.py serves
every row through one intake path, and the writer (net/writer/dispatch.py) asks the row how to
answer. Adding an API is one module here (a parse function, a streamed encoder, a whole
body, an error shape: see route.py) and one row below. gRPC's Generate is a row too
(api/grpc.py: GRPC); it is reached by content-type, not by path.
"""

from . import anthropic, openai, responses
from .native import GENERATE

ROUTES = {
    "/v1/completions": openai.COMPLETIONS,
    "/v1/chat/completions": openai.CHAT,
    "/v1/responses": responses.RESPONSES,
    "/v1/messages": anthropic.MESSAGES,
    "/generate": GENERATE,
}

# what errors look like on each path (the generation rows' own, and their families' other routes)
ERROR_BODIES = {path: route.error_body for path, route in ROUTES.items()}
ERROR_BODIES["/v1/messages/count_tokens"] = anthropic.error_body
