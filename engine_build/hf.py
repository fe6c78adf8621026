"""Hugging Face importer: a model directory -> `SourceModel` in tokenwire's canonical layout.

Reads config.json, generation_config.json, model.safetensors (or the shards listed in
model.safetensors.index.json), tokenizer.json and tokenizer_config.json (chat template also
from chat_template.jinja / chat_template.json). Families: LlamaForCausalLM (incl. Llama 3
`rope_type: llama3`), MistralForCausalLM (sliding window), Qwen2ForCausalLM (q/k/v bias),
GemmaForCausalLM (embedding x sqrt(D), RMSNorm `1 + w` folded, GeGLU with tanh GELU),
Qwen3ForCausalLM (per-head q/k RMSNorm), Gemma2ForCausalLM (sliding window on every other layer,
attention-logit and final-logit soft-capping, norms before and after the attention and the MLP,
softmax scale from query_pre_attn_scalar), Gemma3ForCausalLM (text: as Gemma 2 without the
soft-capping, with per-head q/k norms and its own RoPE base on the sliding layers).

4-bit checkpoints (config.json `quantization_config`: AWQ, GPTQ, compressed-tensors) are read
by hf_quantized.py: the canonical tensors are then their dequantization, and the SourceModel
also carries their codes (`imported`), stored without rounding again.

Both spellings of RoPE settings are understood: transformers < 5 writes `rope_theta` and
`rope_scaling`; transformers 5 writes one `rope_parameters` dict holding both.

    src = import_hf("path/to/model")
    src.config                      # ModelConfig
    src.tensors["layers.0.qkv_proj"]  # float32/float16 [Hq*hd + 2*Hkv*hd, D], rows Q|K|V
"""

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.config import ModelConfig, RopeScaling
from ..core.errors import BuildError
from ..kernels.engine_format import canonical_shapes
from ..kernels.safetensors_io import SafetensorsFile
from .hf_quantized import QuantizedCheckpoint
from .imported import ImportedInt4, Int4Codes, concat_rows, permute_rows
from .source import LazyTensors, SourceModel, make_tokenizer_files
from .tokenizer_convert import sentencepiece_model_to_tokenizer_json

# architecture -> family; the family decides the few defaults configs leave out
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma",
            "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM"}
GEMMA = {"gemma", "gemma2", "gemma3"}      # RMSNorm (1 + w), embedding x sqrt(D), tied by default
TIED_BY_DEFAULT = GEMMA
QK_NORM = {"qwen3", "gemma3"}               # per-head RMSNorm on q and k (q_norm, k_norm [hd])
POST_NORMS = {"gemma2", "gemma3"}           # norms on the attention and MLP outputs (sandwich norms)
ACTIVATIONS = {"silu": "silu", "swish": "silu",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_fast": "gelu_tanh"}
TOKENIZER_EXTRAS = ("special_tokens_map.json", "generation_config.json")


def import_hf(path, kind: str = "hf", name: Optional[str] = None) -> SourceModel:
    root = Path(path)
    if not root.is_dir():
        raise BuildError(root, "not a directory (expected a Hugging Face model directory with config.json)")
    hf_config = read_json(root / "config.json")
    generation_config = read_json(root / "generation_config.json", required=False) or {}
    config = model_config_from_hf(hf_config, generation_config, root / "config.json")
    weights = WeightFiles(root)
    tokenizer, tokenizer_paths = read_hf_tokenizer(root, config)
    config = _with_tokenizer(config, tokenizer, root / "tokenizer.json")
    quant = hf_config.get("quantization_config")
    quantized = QuantizedCheckpoint(quant, weights, root / "config.json") if quant else None
    tensors = _canonical_tensors(config, weights, FAMILIES[config.architecture], root, quantized)
    files = weights.paths + [root / "config.json"] + tokenizer_paths
    return SourceModel(kind=kind, path=str(path), name=name or root.name, config=config,
                       tensors=tensors, tokenizer=tokenizer, files=files,
                       imported=imported_int4(config, quantized) if quantized else None)


def read_json(path: Path, required: bool = True):
    if not path.exists():
        if required:
            raise BuildError(path, "missing file")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BuildError(path, f"not valid JSON: {exc}") from None


# ---- config.json -> ModelConfig ---------------------------------------------------------

def model_config_from_hf(cfg: dict, generation_config: dict, origin) -> ModelConfig:
    architecture = _architecture(cfg, origin)
    family = FAMILIES[architecture]
    _reject_unsupported_biases(cfg, family, origin)
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling, rope_local_theta = _rope(cfg, origin)
        window, sliding_layers = _sliding_window(cfg, family, origin)
        pre_attn_scalar = cfg.get("query_pre_attn_scalar") if family in POST_NORMS else None
        config = ModelConfig(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            activation=_activation(cfg, origin),
            qkv_bias=family == "qwen2",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family in TIED_BY_DEFAULT)),
            embedding_multiplier=math.sqrt(hidden) if family in GEMMA else 1.0,
            sliding_window=window,
            sliding_layers=sliding_layers,
            qk_norm=family in QK_NORM,
            post_norms=family in POST_NORMS,
            attn_scale=float(pre_attn_scalar) ** -0.5 if pre_attn_scalar else None,
            attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")) if family in POST_NORMS else None,
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")) if family in POST_NORMS else None,
            rope_local_theta=rope_local_theta,
            bos_token_id=_first_id(generation_config.get("bos_token_id", cfg.get("bos_token_id"))),
            eos_token_ids=_ids(generation_config.get("eos_token_id")) + _ids(cfg.get("eos_token_id")),
        )
    except KeyError as exc:
        raise BuildError(origin, f"config field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise BuildError(origin, f"bad config value: {exc}") from None
    return _dedup_eos(config)


def _architecture(cfg: dict, origin) -> str:
    names = cfg.get("architectures") or []
    if not names and cfg.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[cfg["model_type"]]]
    supported = [n for n in names if n in FAMILIES]
    if not supported:
        shown = ", ".join(names) or f"model_type {cfg.get('model_type')!r}"
        raise BuildError(origin, f"unsupported architecture {shown}; tokenwire builds {', '.join(FAMILIES)}")
    return supported[0]


def _reject_unsupported_biases(cfg: dict, family: str, origin) -> None:
    if family != "qwen2" and cfg.get("attention_bias"):
        raise BuildError(origin, "attention_bias=true (biases on q/k/v/o projections) is not supported")
    if cfg.get("mlp_bias"):
        raise BuildError(origin, "mlp_bias=true is not supported")


def _rope(cfg: dict, origin) -> tuple:
    """-> (rope_theta, RopeScaling | None, local theta | None) from `rope_parameters` (transformers 5)
    or `rope_theta`/`rope_scaling`; Gemma 3 has one set per layer kind (transformers 5) or
    `rope_local_base_freq` for its sliding layers."""
    per_kind = cfg.get("rope_parameters") or {}
    local = None
    if isinstance(per_kind.get("full_attention"), dict):
        local_params = per_kind.get("sliding_attention") or {}
        if local_params.get("rope_type", "default") != "default":
            raise BuildError(origin, f"RoPE scaling type {local_params.get('rope_type')!r} on sliding layers is not supported")
        local = float(local_params["rope_theta"]) if "rope_theta" in local_params else None
        per_kind = per_kind["full_attention"]
    elif cfg.get("rope_local_base_freq") is not None:
        local = float(cfg["rope_local_base_freq"])
    params = dict(cfg.get("rope_scaling") or {})
    params.update(per_kind)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None, local
    if rope_type != "llama3":
        raise BuildError(origin, f"RoPE scaling type {rope_type!r} is not supported (only 'llama3')")
    return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position_embeddings=int(params["original_max_position_embeddings"])), local


def _optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def _activation(cfg: dict, origin) -> str:
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if name not in ACTIVATIONS:
        raise BuildError(origin, f"activation {name!r} is not supported (tokenwire implements SwiGLU with silu "
                                 f"and GeGLU with tanh-approximated GELU: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _sliding_window(cfg: dict, family: str, origin) -> tuple:
    """-> (window or None, per-layer flags or None for all layers). Mistral slides on every layer;
    the others say per layer (`layer_types`), or by their older fields: Qwen2's
    `use_sliding_window` from `max_window_layers` on, Gemma 2 every other layer from the first,
    Gemma 3 all but every `sliding_window_pattern`-th."""
    window = cfg.get("sliding_window")
    if family == "mistral":
        return (int(window) if window else None), None
    if not window:
        return None, None
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [_legacy_layer_type(cfg, family, i) for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise BuildError(origin, f"layer_types must name sliding_attention or full_attention for each of the "
                                 f"{num_layers} layers, got {layer_types}")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    if not any(sliding):
        return None, None
    return int(window), (None if all(sliding) else sliding)


def _legacy_layer_type(cfg: dict, family: str, i: int) -> str:
    if family == "gemma2":
        slides = i % 2 == 0
    elif family == "gemma3":
        slides = (i + 1) % int(cfg.get("sliding_window_pattern") or 6) != 0
    else:
        slides = bool(cfg.get("use_sliding_window")) and i >= int(cfg.get("max_window_layers") or 0)
    return "sliding_attention" if slides else "full_attention"


def _ids(value) -> tuple:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _first_id(value) -> Optional[int]:
    ids = _ids(value)
    return ids[0] if ids else None


def _dedup_eos(config: ModelConfig) -> ModelConfig:
    return replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids)))


def _with_tokenizer(config: ModelConfig, tokenizer, origin) -> ModelConfig:
    """Check the tokenizer fits the embedding; take its BOS; add its eos_token to the stop ids."""
    if tokenizer.vocab_size > config.vocab_size:
        raise BuildError(origin, f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size "
                                 f"is {config.vocab_size}: ids past the embedding table")
    # the prompt's BOS is whatever the tokenizer calls its bos_token; the configs only fill a gap
    config = replace(config, bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id)
    eos_id = tokenizer.eos_token_id
    if eos_id is None or eos_id in config.eos_token_ids:
        return config
    return replace(config, eos_token_ids=config.eos_token_ids + (eos_id,))


# ---- tokenizer --------------------------------------------------------------------------

def read_hf_tokenizer(root: Path, config: ModelConfig) -> tuple:
    """-> (TokenizerFiles, [paths read]). tokenizer.json, or a SentencePiece tokenizer.model converted."""
    tokenizer_config = read_json(root / "tokenizer_config.json", required=False) or {}
    paths = [p for p in (root / "tokenizer_config.json",) if p.exists()]
    if (root / "tokenizer.json").exists():
        tokenizer_json = (root / "tokenizer.json").read_bytes()
        paths.insert(0, root / "tokenizer.json")
    elif (root / "tokenizer.model").exists():
        tokenizer_json = sentencepiece_model_to_tokenizer_json(root / "tokenizer.model")
        paths.insert(0, root / "tokenizer.model")
    else:
        raise BuildError(root / "tokenizer.json", "missing file (no tokenizer.json or tokenizer.model in the model directory)")
    chat_template, template_path = _chat_template_file(root)
    paths += [template_path] if template_path else []
    extras = {n: (root / n).read_bytes() for n in TOKENIZER_EXTRAS if (root / n).exists()}
    paths += [root / n for n in TOKENIZER_EXTRAS if (root / n).exists()]
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    files = make_tokenizer_files(tokenizer_json, tokenizer_config, root / "tokenizer.json", chat_template=chat_template,
                                 extra_files=extras, bos_token_id=config.bos_token_id, eos_token_id=eos)
    return files, paths


def _chat_template_file(root: Path) -> tuple:
    """transformers >= 4.43 saves the template beside tokenizer_config.json."""
    if (root / "chat_template.jinja").exists():
        return (root / "chat_template.jinja").read_text(encoding="utf-8"), root / "chat_template.jinja"
    if (root / "chat_template.json").exists():
        return (read_json(root / "chat_template.json") or {}).get("chat_template"), root / "chat_template.json"
    return None, None


# ---- weights ----------------------------------------------------------------------------

class WeightFiles:
    """HF tensor name -> the memory-mapped safetensors file holding it."""

    def __init__(self, root: Path):
        index_path = root / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = (read_json(index_path) or {}).get("weight_map")
            if not isinstance(weight_map, dict):
                raise BuildError(index_path, "no 'weight_map' object")
            shard_names = sorted(set(weight_map.values()))
            self.paths = [index_path] + [root / n for n in shard_names]
        elif (root / "model.safetensors").exists():
            shard_names, weight_map = ["model.safetensors"], None
            self.paths = [root / "model.safetensors"]
        else:
            found = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
            hint = f" (found {', '.join(found)}: only safetensors weights are supported)" if found else ""
            raise BuildError(root / "model.safetensors", f"missing file: no model.safetensors or model.safetensors.index.json{hint}")
        for n in shard_names:
            if not (root / n).exists():
                raise BuildError(root / n, f"missing file (listed in {index_path.name})")
        shards = {n: SafetensorsFile(root / n) for n in shard_names}
        self._where = {}
        for n, shard in shards.items():
            for key in shard.keys():
                self._where[key] = shard
        if weight_map is not None:      # the index decides which shard holds a name
            self._where.update({k: shards[v] for k, v in weight_map.items() if k in shards[v]})
        self.root = root

    def __contains__(self, name) -> bool:
        return name in self._where

    def read(self, name: str, shape: tuple) -> np.ndarray:
        """float32/float16 array of the HF tensor `name`, checked against the config's `shape`."""
        shard = self._where.get(name)
        if shard is None:
            raise BuildError(self.root, f"tensor {name!r} is missing from the safetensors weights")
        if tuple(shard.shape(name)) != tuple(shape):
            raise BuildError(shard.path, f"tensor {name!r} has shape {list(shard.shape(name))}, "
                                         f"config.json implies {list(shape)}")
        return shard.read_float(name)

    def read_raw(self, name: str, shape: tuple) -> np.ndarray:
        """The stored array of `name` in its own dtype (packed int32, g_idx), shape checked (-1: any)."""
        shard = self._where.get(name)
        if shard is None:
            raise BuildError(self.root, f"tensor {name!r} is missing from the safetensors weights")
        got = tuple(shard.shape(name))
        if len(got) != len(shape) or any(w not in (-1, g) for w, g in zip(shape, got)):
            raise BuildError(shard.path, f"tensor {name!r} has shape {list(got)}, config.json implies {list(shape)}")
        return shard.read_raw(name)


def linear_parts(config: ModelConfig) -> dict:
    """canonical matrix name -> [(HF module prefix, [N, K])], rows stacked in this order."""
    D, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    parts = {}
    for i in range(config.num_layers):
        a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        parts[p + "qkv_proj"] = [(a + "q_proj", (q, D)), (a + "k_proj", (kv, D)), (a + "v_proj", (kv, D))]
        parts[p + "o_proj"] = [(a + "o_proj", (D, q))]
        parts[p + "gate_up_proj"] = [(m + "gate_proj", (I, D)), (m + "up_proj", (I, D))]
        parts[p + "down_proj"] = [(m + "down_proj", (D, I))]
    if not config.tie_word_embeddings:
        parts["lm_head"] = [("lm_head", (V, D))]
    return parts


def _canonical_tensors(config: ModelConfig, weights: WeightFiles, family: str, origin,
                       quantized: Optional[QuantizedCheckpoint] = None) -> LazyTensors:
    """Loaders for every canonical tensor: fusion (Q|K|V, gate|up) and Gemma's norm fold.
    A 4-bit checkpoint's matrices are its own dequantization (hf_quantized.py)."""
    D, V = config.hidden_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    norm = (lambda w: w.astype(np.float32) + np.float32(1.0)) if family in GEMMA else (lambda w: w.astype(np.float32))
    hd = config.head_dim
    read = weights.read
    linear = quantized.read_float if quantized is not None else (lambda prefix, shape: read(prefix + ".weight", shape))
    loaders = {"embed": lambda: read("model.embed_tokens.weight", (V, D))}
    for name, parts in linear_parts(config).items():
        loaders[name] = lambda parts=parts: np.concatenate([linear(prefix, shape) for prefix, shape in parts])
    if quantized is not None:
        for i in range(config.num_layers):
            _mlp_order(config, quantized, i, loaders, lambda base, order: base()[:, order])
    for i in range(config.num_layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        a = hf + "self_attn."
        loaders[p + "attn_norm"] = lambda n=hf + "input_layernorm.weight": norm(read(n, (D,)))
        if config.qkv_bias:
            loaders[p + "qkv_bias"] = lambda a=a: np.concatenate(
                [read(a + "q_proj.bias", (q,)), read(a + "k_proj.bias", (kv,)), read(a + "v_proj.bias", (kv,))]
            ).astype(np.float32)
        if config.post_norms:       # Gemma 2/3: post_attention_layernorm is the attention output's norm
            loaders[p + "post_attn_norm"] = lambda n=hf + "post_attention_layernorm.weight": norm(read(n, (D,)))
            loaders[p + "mlp_norm"] = lambda n=hf + "pre_feedforward_layernorm.weight": norm(read(n, (D,)))
            loaders[p + "post_mlp_norm"] = lambda n=hf + "post_feedforward_layernorm.weight": norm(read(n, (D,)))
        else:
            loaders[p + "mlp_norm"] = lambda n=hf + "post_attention_layernorm.weight": norm(read(n, (D,)))
        if config.qk_norm:
            loaders[p + "q_norm"] = lambda n=a + "q_norm.weight": norm(read(n, (hd,)))
            loaders[p + "k_norm"] = lambda n=a + "k_norm.weight": norm(read(n, (hd,)))
    loaders["norm"] = lambda: norm(read("model.norm.weight", (D,)))
    return LazyTensors(canonical_shapes(config), loaders, origin)


def _mlp_order(config: ModelConfig, quantized: QuantizedCheckpoint, i: int, loaders: dict, down_in_order) -> None:
    """Act-order down_proj (hf_quantized.py): wrap layer i's loaders so its columns come in group
    order and the gate and up rows in the same order (the same function, every group contiguous).
    `down_in_order(base loader, order)` reorders the down projection's columns."""
    I = config.intermediate_size
    down = f"model.layers.{i}.mlp.down_proj"
    order = lambda: quantized.input_order(down, (config.hidden_size, I))    # noqa: E731
    p = f"layers.{i}."
    gate_up, down_loader = loaders.get(p + "gate_up_proj"), loaders[p + "down_proj"]

    def gate_up_in_order():
        o = order()
        w = gate_up()
        return w if o is None else _rows_in_order(w, o, I)

    def down_in_order_or_not():
        o = order()
        return down_loader() if o is None else down_in_order(down_loader, o)
    loaders[p + "down_proj"] = down_in_order_or_not
    if gate_up is not None:             # (a float gate_up of a 4-bit checkpoint is reordered by the float loaders)
        loaders[p + "gate_up_proj"] = gate_up_in_order


def _rows_in_order(w, order: np.ndarray, I: int):
    """gate | up rows (an array or Int4Codes), each half reordered by `order`."""
    rows = np.concatenate([order, I + order])
    return permute_rows(w, lambda a: a[rows]) if isinstance(w, Int4Codes) else w[rows]


def imported_int4(config: ModelConfig, quantized: QuantizedCheckpoint) -> ImportedInt4:
    """The checkpoint's 4-bit matrices as INT4 codes, fused like the float view."""
    loaders, notes = {}, {}
    for name, parts in linear_parts(config).items():
        flags = [quantized.is_quantized(prefix) for prefix, _ in parts]
        if not any(flags):
            continue
        if not all(flags):
            raise BuildError(quantized.origin, f"{name}: the checkpoint quantizes only some of "
                                               f"{', '.join(p for p, _ in parts)}")
        loaders[name] = lambda parts=parts: concat_rows([quantized.read_codes(prefix, shape) for prefix, shape in parts])
        notes[name] = quantized.description
    for i in range(config.num_layers):
        if f"layers.{i}.down_proj" in loaders:
            shape = (config.hidden_size, config.intermediate_size)
            _mlp_order(config, quantized, i, loaders, lambda base, order, i=i: quantized.read_codes(
                f"model.layers.{i}.mlp.down_proj", shape, order))
    return ImportedInt4(quantized.group_size, loaders, notes, frozenset(loaders))
