"""The embedded default model: what `tokenwire serve` runs when no `--model` is given.

It is honest about what it is: random weights (fixed seed), not a trained model, so its
output is meaningless text. It exists so the server, the benchmarks and CI run anywhere with
no download. Everything is derived deterministically from this file:
- the tokenizer: a byte-level BPE trained with `tokenizers` on an original text shipped with
  tokenwire (data/default_tokenizer_corpus.txt), with ChatML-style special tokens and a chat
  template; the model's vocab_size is exactly the tokenizer's size;
- the weights: the transformer layer shape of SmolLM2-135M (hidden 576, intermediate 1536,
  9 query heads, 3 KV heads, head_dim 64, tied embeddings), NUM_LAYERS layers, matrices
  uniform with standard deviation 0.02 drawn from a fixed seed per tensor, norms 1;
- the engine: INT4, group 64, asymmetric, round-to-nearest (no calibration: there is nothing
  to calibrate on random weights).

`default_engine_path()` builds it on first use into `<cache>/engines/default-<recipe hash>`
(see cache.py), writing to a temporary directory renamed into place, so two
processes racing to build it both end up with one complete engine.
"""

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..core.config import ModelConfig
from ..kernels.engine_format import MANIFEST, canonical_shapes
from .build import BuildOptions, build_engine
from .cache import engines_dir
from .quantize import QuantOptions
from .source import LazyTensors, SourceModel, make_tokenizer_files

NAME = "tokenwire-default-random"
SEED = 0
NUM_LAYERS = 30
INIT_STD = 0.02
RECIPE_VERSION = 2                      # bump when anything below changes the engine's bytes
CORPUS = Path(__file__).resolve().parent / "data" / "default_tokenizer_corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_LIMIT = 4096            # the trainer stops earlier: the corpus supports fewer merges
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYER_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)


def default_engine_path(cache_dir=None, progress: bool = False, log: Callable[[str], None] = lambda line: None) -> Path:
    """-> the default engine directory, built first if it is not in the cache yet (idempotent)."""
    target = engines_dir(cache_dir) / f"default-{recipe_hash()[:12]}"
    if (target / MANIFEST).is_file():
        return target
    log(f"building the default model ({NAME}) into {target}")
    options = BuildOptions(QuantOptions(method="int4", group_size=64, algorithm="rtn"))
    return build_engine(default_source(), target, options, progress=progress, log=log, exists="keep")


def recipe() -> dict:
    """Everything that decides the default engine's bytes."""
    return {"name": NAME, "version": RECIPE_VERSION, "seed": SEED, "num_layers": NUM_LAYERS, "init_std": INIT_STD,
            "layer_shape": LAYER_SHAPE, "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
            "special_tokens": SPECIAL_TOKENS, "chat_template": CHAT_TEMPLATE, "tokenizers": tokenizers.__version__}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()


def default_source() -> SourceModel:
    """The default model as a SourceModel: tokenizer trained now, weights drawn on access."""
    tokenizer = default_tokenizer_files()
    config = default_config(tokenizer.vocab_size)
    config = replace(config, eos_token_ids=tuple(_special_id(tokenizer, t) for t in ("<|im_end|>", "<|endoftext|>")))
    shapes = canonical_shapes(config)
    loaders = {name: (lambda i=i, shape=shape, name=name: _random_tensor(i, name, shape)) for i, (name, shape)
               in enumerate(shapes.items())}
    description = (f"random weights (seed {SEED}), not a trained model: the layer shape of SmolLM2-135M "
                   f"(hidden 576, intermediate 1536, 9 heads, 3 KV heads, head_dim 64) with {NUM_LAYERS} layers "
                   f"and a {config.vocab_size}-token byte-level BPE vocabulary; INT4 g64; output is meaningless text")
    return SourceModel(kind="default", path=f"tokenwire:{NAME}", name=NAME, config=config,
                       tensors=LazyTensors(shapes, loaders, NAME), tokenizer=tokenizer, files=[],
                       description=description, checksum=recipe_hash())


def default_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, num_layers=NUM_LAYERS,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                       tie_word_embeddings=True, **LAYER_SHAPE)


def _random_tensor(index: int, name: str, shape: tuple) -> np.ndarray:
    """Matrices uniform in [-a, a] with std INIT_STD (5x faster to draw than normal), norms ones.
    Each tensor has its own seed, so the order of access does not matter."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([SEED, index])
    w = rng.random(shape, dtype=np.float32)                 # [0, 1)
    w -= np.float32(0.5)
    w *= np.float32(2 * INIT_STD * np.sqrt(3.0))
    return w


def default_tokenizer_files():
    """Train the byte-level BPE on the shipped corpus (deterministic; ~0.1 s) -> TokenizerFiles."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_LIMIT, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "add_bos_token": False, "model_max_length": 2048}
    generation = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    return make_tokenizer_files(tok.to_str().encode(), config, CORPUS, chat_template=CHAT_TEMPLATE,
                                extra_files={"generation_config.json": json.dumps(generation, indent=2).encode()})


def _special_id(tokenizer, token: str) -> int:
    return Tokenizer.from_str(tokenizer.files["tokenizer.json"].decode()).token_to_id(token)
