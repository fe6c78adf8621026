"""Model hyperparameters: the one record every part of tokenwire agrees on.

Importers (engine_build/) fill it from a checkpoint's config; the engine manifest stores it
(`engine.json` -> "model"); the forward passes (kernels/model.py, kernels/) read it. Family
quirks are expressed as plain fields here, so no forward pass branches on a family name:

- Gemma's RMSNorm `(1 + w)` is folded into the stored norm weights at build time;
- Gemma's `sqrt(hidden_size)` embedding scale is `embedding_multiplier`;
- llama2.c's interleaved RoPE layout is permuted to the rotate-half layout at import;
- Qwen3's and Gemma 3's per-head RMSNorm on q and k is `qk_norm`; Gemma 2/3's norms on the
  attention and MLP outputs are `post_norms`; their softmax scale `attn_scale`, logit
  soft-capping `attn_logit_softcap` / `final_logit_softcap`, the layers that use the sliding
  window `sliding_layers`, and Gemma 3's RoPE base for those layers `rope_local_theta`.
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
    sliding_layers: Optional[tuple] = None    # per layer: uses sliding_window (Gemma 2/3 alternate); None: all layers
    qk_norm: bool = False           # Qwen3, Gemma 3: RMSNorm over each head's q and k (weights [hd]) before RoPE
    post_norms: bool = False        # Gemma 2/3: RMSNorm on the attention and MLP outputs before each residual add
    attn_scale: Optional[float] = None          # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: Optional[float] = None  # Gemma 2: scores = cap * tanh(scores / cap) before the mask
    final_logit_softcap: Optional[float] = None  # Gemma 2: logits = cap * tanh(logits / cap)
    rope_local_theta: Optional[float] = None    # Gemma 3: RoPE base of the sliding-window layers
    rope_freq_factors: Optional[tuple] = None   # GGUF rope_freqs (Llama 3.1): inv_freq[j] / factor[j], hd/2 values
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """RoPE base of `layer`: Gemma 3's sliding layers have their own."""
        local = self.rope_local_theta is not None and self.layer_window(layer) is not None
        return self.rope_local_theta if local else self.rope_theta

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.sliding_layers is not None:
            d["sliding_layers"] = list(self.sliding_layers)
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
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
        if d.get("sliding_layers") is not None:
            d["sliding_layers"] = tuple(bool(x) for x in d["sliding_layers"])
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(float(x) for x in d["rope_freq_factors"])
        return cls(**d)
