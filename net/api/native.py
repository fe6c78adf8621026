"""tokenwire's native route, `POST /generate`: a prompt (text or token ids) in, one NDJSON
line per token out (encoders.Ndjson), or int32 token ids with `Accept:
application/octet-stream` (encoders.BinaryTokens). Always streamed; errors in OpenAI's shape.
"""

from ..writer import encoders
from .errors import bad_param
from .fields import SPECULATIVE_KEYS, check_keys, opt, sampling, token_ids
from .route import GenerationRequest, Route
from .structured import GUIDED_KEYS, REFUSED_GUIDED_KEYS, constraint_spec

_KEYS = {"user", "nvext", "prompt", "prompt_token_ids", "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
         "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop", "stop_token_ids",
         "ignore_eos", "skip_special_tokens", "model", "response_format", "structured_outputs", *GUIDED_KEYS,
         *REFUSED_GUIDED_KEYS, *SPECULATIVE_KEYS}


def parse_generate(body: dict, on_unknown=None) -> GenerationRequest:
    check_keys(body, _KEYS, on_unknown)
    has_text, has_ids = body.get("prompt") is not None, body.get("prompt_token_ids") is not None
    if has_text == has_ids:
        raise bad_param("prompt", "give exactly one of prompt (a string) and prompt_token_ids (a list of ints)")
    prompt = opt(body, "prompt", str, None)
    prompt_ids = token_ids(body["prompt_token_ids"], "prompt_token_ids") if has_ids else None
    params = sampling(body, max_tokens=opt(body, "max_tokens", int, None), logprobs=None)
    constraint, constraint_param = constraint_spec(body)
    return GenerationRequest(GENERATE, prompt, prompt_ids, None, params, True, True, False,
                             opt(body, "model", str, None), constraint=constraint, constraint_param=constraint_param)


def _encoder(g, served, response_id, created, index, num_prompt, headers):
    return encoders.BinaryTokens() if "application/octet-stream" in headers.get("accept", "") else encoders.Ndjson()


GENERATE = Route("generate", parse_generate, "gen-", "prompt", _encoder, None, allows_token_ids=True)
