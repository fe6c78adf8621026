"""Every option that shapes the engine a server runs, with its default: written here and
nowhere else.

`tokenwire serve` makes its flags from these fields (tokenwire/serve.py reads the defaults),
`tokenwire.Server` takes them as keyword arguments, and tokenwire/runtime.py builds the
engine from one `EngineOptions`. Code that needs a default elsewhere (EngineCore's keyword
arguments, the CUDA backend's options) refers to `DEFAULTS.<field>` instead of repeating
the number. Network limits are net/'s own (`net/events.Limits`).
"""

from dataclasses import dataclass, fields
from typing import Optional

from .sampling_params import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

ACTIVATIONS = ("int8", "fp32")          # the cpu backend's INT4-product activations (kernels/cpu/README.md)


@dataclass(frozen=True)
class EngineOptions:
    model: Optional[str] = None             # engine dir, HF dir, hub name or llama2.c .bin; None: the embedded default
    backend: str = "cpu"                    # a row of kernels.BACKENDS
    served_model_name: Optional[str] = None     # the id in /v1/models and responses (None: the model's name)
    chat_template: Optional[str] = None     # a Jinja file (or tokenizer_config.json) overriding the model's
    max_model_len: Optional[int] = None     # context length; None: the model's max_position_embeddings
    max_num_seqs: int = 256                 # largest running batch
    max_num_batched_tokens: int = 2048      # tokens per step (prefill chunks + decodes)
    # prompt tokens a step that carries decodes may take (core/step_costs.py): -1 measured from the
    # steps, so such a step stays within a quarter of a decode step of one (prompts still move by
    # the floor of those pending, step_costs.prefill_floor); 0 no cap; N at most N
    prefill_cap: int = -1
    max_queued_requests: int = 1024         # requests waiting for the scheduler before 429
    block_size: int = 16                    # tokens per KV block
    num_kv_blocks: Optional[int] = None     # KV blocks; None: sized by the backend from its memory budget
    kv_cache_bytes: Optional[int] = None    # that budget; None: the backend's default (1 GiB on the CPU)
    mock_step_us: float = 0.0               # mock backend: microseconds per engine step
    enable_prefix_caching: bool = True      # reuse cached KV blocks of known prefixes (core/prefix_cache.py)
    response_cache_size: int = 0            # exact-match answers kept (core/response_cache.py); 0: off
    # executor steps at most this long run on the event loop instead of the engine thread: a hand-off
    # costs ~10 us of CPU and two context switches per step (core/engine_core.py, "Inline steps"), and
    # the loop may wait this long; the mock's steps are ~1 us, stories260K's ~125 us; 0: always the thread
    inline_step_us: float = 50.0
    # launch each step before the last one's ids are processed, so the host's work (schedule, batch,
    # detokenize, stops, hand-off) runs while the executor's step does (core/step_driver.py); only
    # where the executor's step overlaps (cuda, mock: it waits without the GIL); the cpu backend's
    # step computes on the engine thread and never overlaps
    overlap: bool = True
    # run the engine (scheduler, executor, detokenizer) in a child process of its own, so the event
    # loop and the engine each have a GIL (tokenwire/engine_process.py): for busy servers whose host
    # work per token outgrows one core (1 ms mock steps at 256 streams: 0.61-0.79 of ideal against
    # 0.56-0.67); costs a socket hop per step and per submission (~35% more CPU per token over both
    # processes; at 64 streams 0.82-0.94 against 0.96-0.97) and a second copy of the tokenizer
    # (README, --engine-process)
    engine_process: bool = False
    # cpu backend: the INT4 products' activations, "int8" (quantized per group of 64, as llama.cpp's
    # 4-bit products: perplexity +0.01-0.02%, `tokenwire bench numerics`) or "fp32" (exact: matches the
    # numpy reference to float32 rounding, the golden path)
    activations: str = "int8"
    # run a prefill, a decode and sampling with and without a grammar through the engine before it
    # serves (tokenwire/runtime.py: warm_up), so /health turns 200 only once a first request is as
    # fast as the fifth (the KV cache's first-touch page faults alone cost 0.3-0.6 s on the default model)
    warm_up: bool = True
    # speculative decoding (core/speculative.py): "ngram" (prompt lookup), "draft" (a second model,
    # `speculative_model`) or "off"; a request may ask for another method (its `speculative` field).
    # Off by default: it pays where the output repeats its context (code edits, RAG, quotes), and
    # costs up to ~3% where it never does (adaptive k: README, "Speculative decoding")
    speculative: str = "off"
    num_speculative_tokens: int = 4         # k: tokens proposed and verified per step, at most
    speculative_model: Optional[str] = None     # the draft model (same tokenizer); a model spec as `model`

    def __post_init__(self):
        if self.prefill_cap < -1:
            raise ValueError(f"prefill_cap must be -1 (measured), 0 (off) or a token count, got {self.prefill_cap}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queued_requests", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.response_cache_size < 0:
            raise ValueError(f"response_cache_size must be >= 0, got {self.response_cache_size}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative 'draft' needs a draft model (--speculative-model PATH)")
        for name in ("mock_step_us", "inline_step_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULTS = EngineOptions()
FIELDS = frozenset(f.name for f in fields(EngineOptions))
