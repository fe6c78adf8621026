"""Model shapes the engine benchmarks run, and random-weight engines of any shape.

`SHAPES` are published configs the CPU benchmark knows (in ModelConfig fields);
`SHAPES_CUDA` adds the ones only a GPU runs in reasonable time. `random_engine` makes engine
tensors of a config with random INT4 codes (docs/ENGINE_FORMAT.md), so a benchmark needs no
checkpoint: the kernels' speed does not depend on the values.
"""

import numpy as np

from ..core.config import ModelConfig
from ..engine_build import default_model
from ..kernels.engine_format import linear_shapes, vector_shapes

SHAPES = {  # the published configs, in ModelConfig fields
    "qwen2.5-0.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True),
    "tinyllama-1.1b": dict(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-3.2-1b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
# the embedded default model `tokenwire serve` runs without --model (engine_build/default_model.py);
# its trained tokenizer has 781 tokens
SHAPES["default"] = dict(architecture="LlamaForCausalLM", vocab_size=781, num_layers=default_model.NUM_LAYERS,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, **default_model.LAYER_SHAPE)
SHAPES_CUDA = {
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}


def all_shapes() -> dict:
    return {**SHAPES, **SHAPES_CUDA}


def shape_config(shape: str) -> ModelConfig:
    return ModelConfig.from_dict(all_shapes()[shape])


def random_engine(config, group_size: int, embedding: str, seed: int = 0) -> dict:
    """Engine tensors of `config` with random codes: every matrix INT4, embed/lm_head per `embedding`."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (n, k) in linear_shapes(config).items():
        encoding = embedding if name in ("embed", "lm_head") else "int4"
        tensors.update({f"{name}.{part}": a for part, a in random_matrix(rng, n, k, group_size, encoding).items()})
    for name, shape in vector_shapes(config).items():
        tensors[name] = (1.0 + 0.01 * rng.standard_normal(shape)).astype(np.float32)
    return tensors


def random_matrix(rng, n: int, k: int, group_size: int, encoding: str) -> dict:
    if encoding == "fp16":
        return {"weight": (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16)}
    if encoding == "int8":
        return {"qweight": rng.integers(-127, 128, (n, k), dtype=np.int8),
                "scales": np.full(n, 0.02 / 64, dtype=np.float16)}
    kp = -(-k // group_size) * group_size
    codes = np.frombuffer(rng.bytes(n * kp // 2), dtype=np.uint8).reshape(n, kp // 2)
    scales = (rng.random((n, kp // group_size), dtype=np.float32) * 0.01 + 0.005).astype(np.float16)
    zeros = rng.integers(6, 11, (n, kp // group_size)).astype(np.float16)
    return {"qweight": codes, "scales": scales, "zeros": zeros}
