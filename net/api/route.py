"""The typed route value every generation request carries, and the request it parses into.

An API family is one module (openai.py: completions and chat; responses.py: OpenAI
Responses; anthropic.py: Anthropic Messages; native.py: /generate; grpc.py: gRPC's
Generate) that defines its `Route` rows. `net/api/__init__.py:ROUTES` maps each HTTP path
to its row; from there every family goes through one intake path (`App._generation` in
net/app.py: auth, content type, JSON, parse, prompt, tokenize, submit) and one writer
(net/writer/dispatch.py), which ask the row, never a route name, how this family's body parses,
how its stream and whole responses are encoded, and what its errors look like.

Rules:
1. A route's parse returns a `GenerationRequest` whose `route` is that row; the request
   carries it to the dispatcher (`Exchange.route`), so a family is chosen once, at intake.
2. A family's 400s name the field (`ApiError.param`); its `error_body` turns any `ApiError`
   into the family's own error shape (OpenAI's `{"error": {...}}`, Anthropic's
   `{"type": "error", "error": {...}}`).
3. Streamed encoders share encoders._Stream's interface (`first_token`, `token`,
   `text_parts` or `splice`, `finish`, `trailers`); the per-token work is the encoder's.
"""

from typing import Callable, NamedTuple

from ...core.constraint import ConstraintSpec
from ...core.sampling_params import SamplingParams
from .errors import ApiError
from .structured import ToolPlan


class Served(NamedTuple):
    """What a family's encoders and bodies need of the served model (made once by App.attach)."""
    model: str                          # the model's name in every response
    token_text: Callable[[int], str]    # one token's text (logprobs)
    eos_token_ids: frozenset            # what ends a turn (Anthropic: end_turn rather than stop_sequence)


class Route(NamedTuple):
    """One generation route of one API family."""
    name: str                           # "completions", "chat", "responses", "messages", "generate", "grpc":
                                        # access lines, traces, the unknown-parameter log
    parse: Callable                     # (body: dict, on_unknown) -> GenerationRequest
    id_prefix: str                      # a response's id: this + its engine request id ("chatcmpl-", "msg_", ...)
    prompt_param: str                   # the field a prompt longer than the context names
    stream_encoder: Callable            # (g, served, response_id, created, index, num_prompt, headers) -> encoder
    whole_body: Callable | None         # (g, served, response_id, created, text, finish_reason, use, token_ids,
                                        #  logprobs) -> bytes: a non-streamed 200 body (None: always streamed)
    tools_body: Callable | None = None  # (g, served, response_id, created, content, calls, finish_reason, use,
                                        #  timings) -> (headers, body): tool calls read back at the end
    error_body: Callable[[ApiError], bytes] = ApiError.body     # the family's error shape
    chat: bool = False                  # the prompt is `messages` through the model's chat template
    streams_named_tool: bool = False    # a named tool's arguments stream token by token (else read back at the end)
    allows_token_ids: bool = False      # the prompt may be token ids (completions, generate, gRPC)
    max_tokens_param: str = "max_tokens"    # the field a max_tokens beyond the context names


class GenerationRequest(NamedTuple):
    """A validated generation request, before tokenization."""
    route: Route                        # its family's row (rule 1)
    prompt: str | None                  # text prompt (completions, generate)
    prompt_token_ids: list | None       # pre-tokenized prompt (completions, generate)
    messages: list | None               # chat messages, for the chat template
    params: SamplingParams
    stream: bool
    include_usage: bool                 # stream_options.include_usage
    continuous_usage: bool              # stream_options.continuous_usage_stats: usage on every chunk
    model: str | None                   # as the client named it (checked against the served name)
    n: int = 1                          # choices returned
    best_of: int = 1                    # choices sampled (>= n; completions only, not streamed)
    constraint: ConstraintSpec | None = None    # the output must match it (response_format, guided_*, tools)
    constraint_param: str | None = None # the request field that asked for it: errors about it name this
    tools: ToolPlan | None = None       # chat with tools: how the output is read back
    template_tools: list | None = None  # the tools as the chat template receives them
    echo: dict | None = None            # what the family's response repeats of the request (Responses:
                                        # instructions, tools, text.format, ...)
