"""Random-weight engine directories of each family's quirks, with a word-level tokenizer, built
by engine_build the way a checkpoint is: for tests that run the whole engine on them."""

import json
import math

import numpy as np

from tokenwire.core.config import ModelConfig, RopeScaling
from tokenwire.engine_build.build import BuildOptions, build_engine
from tokenwire.engine_build.quantize import QuantOptions
from tokenwire.engine_build.source import LazyTensors, SourceModel, make_tokenizer_files
from tokenwire.kernels.engine_format import linear_shapes, load_engine, vector_shapes


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=80,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_ids=(2,))
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_configs() -> dict:
    """family -> config: the quirks each family brings to the forward (GQA/MQA, qkv bias and
    sliding windows, GeGLU with an embedding multiplier and tied embeddings, Llama 3 RoPE
    scaling, q/k norms, soft caps and per-layer windows)."""
    return {
        "llama": tiny_config(),
        "llama3": tiny_config(rope_theta=500000.0, num_kv_heads=4, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32)),
        "mistral_qwen2": tiny_config(qkv_bias=True, sliding_window=5, num_kv_heads=1),
        "gemma": tiny_config(activation="gelu_tanh", embedding_multiplier=8.0, tie_word_embeddings=True,
                             head_dim=32, num_heads=2, num_kv_heads=1),
        "qwen3": tiny_config(qk_norm=True, head_dim=32, num_heads=4, num_kv_heads=2, rope_theta=1e6),
        "gemma2": tiny_config(activation="gelu_tanh", embedding_multiplier=8.0, tie_word_embeddings=True,
                              post_norms=True, attn_scale=24 ** -0.5, attn_logit_softcap=3.0, final_logit_softcap=8.0,
                              sliding_window=5, sliding_layers=(True, False), num_heads=2, num_kv_heads=1, head_dim=64),
        "gemma3": tiny_config(activation="gelu_tanh", qk_norm=True, post_norms=True, sliding_window=4,
                              sliding_layers=(False, True), rope_theta=1e6, rope_local_theta=10000.0, attn_scale=0.2,
                              head_dim=16),
    }


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return make_tokenizer_files(tok.to_str().encode(), {"bos_token": "<s>", "eos_token": "</s>"}, "test")


def random_engine(config: ModelConfig, directory, seed: int = 0, scale: float = 2.0, quant: str = "int4"):
    """A loaded engine of random weights (matrices ~ N(0, scale^2 / fan_in)); `quant` "int4" (RTN,
    group 32) or "none"."""
    shapes = {**linear_shapes(config), **vector_shapes(config)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "embed":
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape) / math.sqrt(shape[1]) * scale).astype(np.float32)
    source = SourceModel(kind="default", path="test:random", name="random", config=config,
                         tensors=LazyTensors(shapes, {n: (lambda n=n: tensors[n]) for n in shapes}, "random"),
                         tokenizer=word_tokenizer(config.vocab_size), files=[],
                         checksum=json.dumps([seed, scale, repr(config)]))
    options = QuantOptions(method="none") if quant == "none" else QuantOptions(method="int4", algorithm="rtn",
                                                                              group_size=32)
    return load_engine(build_engine(source, directory / "engine", BuildOptions(quant=options)))
