"""Model hyperparameters: the one record every part of tokenwire agrees on.

Importers (engine_build/) fill it from a checkpoint's config; the engine manifest stores it
(`engine.json` -> "model"); the forward passes (kernels/model.py, kernels/) read it. Family
quirks are expressed as plain fields here, so no forward pass branches on a family name:

- Gemma's RMSNorm `(1 + w)` is folded into the stored norm weights at build time;
- Gemma's `sqrt(hidden_size)` embedding scale is `embedding_multiplier`;
- llama2.c's interleaved RoPE layout is permuted to the rotate-half layout at import.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Mistral, Qwen2), GeGLU with tanh GELU (Gemma)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_scaling.rope_type == "llama3"`)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str               # source class name, e.g. "LlamaForCausalLM" (informational)
    vocab_size: int
    hidden_size: int                # D
    intermediate_size: int          # I, per gate/up projection
    num_layers: int
    num_heads: int                  # query heads
    num_kv_heads: int               # < num_heads for GQA, 1 for MQA
    head_dim: int                   # not always hidden_size // num_heads (Gemma)
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling] = None
    activation: str = "silu"
    qkv_bias: bool = False          # Qwen2
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0   # Gemma: sqrt(hidden_size)
    sliding_window: Optional[int] = None  # Mistral: attend to the last N positions only
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)
