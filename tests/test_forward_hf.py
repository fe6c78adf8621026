"""The reference forward against transformers' own forward pass, family by family.

Each test builds a tiny random-weight model with transformers (fp32, saved with
save_pretrained), imports it with engine_build/hf.py, encodes it with `--quant none`, and
runs batched prefill of different prompt lengths then 32 decode steps, with every
sequence's KV blocks scattered over the cache in shuffled order, once with whole-prompt
prefill and once with chunked prefill mixed with other sequences' decode tokens. Every
logit row must match transformers' within 1e-4.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenwire.core.executor import SeqStep  # noqa: E402
from tokenwire.kernels.forward_batch import build_forward_batch  # noqa: E402
from tokenwire.kernels.model import ReferenceModel  # noqa: E402
from tokenwire.core.sampling_params import SamplingParams  # noqa: E402
from tokenwire.engine_build.hf import import_hf  # noqa: E402
from tokenwire.engine_build.quantize import QuantOptions, quantize_model  # noqa: E402

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, initializer_range=0.15, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)),
    "llama3": ("LlamaForCausalLM", "LlamaConfig",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32})),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=7, rope_theta=1e6)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                   hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6)),
    # windows of 6 (< the 45-position sequences) on layer 0 only, soft caps low enough to bend
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                    sliding_window=6, attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                    hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                    sliding_window=5, hidden_activation="gelu_pytorch_tanh",
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}
GEMMAS = ("gemma", "gemma2", "gemma3")
PROMPT_LENS = (5, 13, 1, 9)
NUM_DECODE = 32
BLOCK_SIZE = 4


def make_hf_model(family: str, directory, seed: int = 0):
    """A random fp32 model of `family` saved to `directory` with a word-level tokenizer; -> torch model."""
    arch, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):          # not all ones (Gemma stores w of 1 + w)
                p.copy_((0.0 if family in GEMMAS else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):               # Qwen2's q/k/v biases start at zero
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model


def write_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def step(seq_id, token_ids, start_pos, table, sample):
    return SeqStep(seq_id, list(token_ids), start_pos, list(table), sample, SamplingParams(temperature=0.0), 0, [], [])


def run_reference(model: ReferenceModel, sequences, prompt_lens, chunk, tables) -> dict:
    """Feed every sequence: its prompt in chunks of `chunk` (None: whole), then one token per
    step, all sequences in the same steps. -> {(seq, position): logits of that position}."""
    fed = [0] * len(sequences)
    got = {}
    while any(f < len(s) for f, s in zip(fed, sequences)):
        steps, owners = [], []
        for i, (seq, n_prompt) in enumerate(zip(sequences, prompt_lens)):
            if fed[i] >= len(seq):
                continue
            end = min(fed[i] + (chunk or n_prompt), n_prompt) if fed[i] < n_prompt else fed[i] + 1
            sample = end >= n_prompt
            steps.append(step(i, seq[fed[i]:end], fed[i], tables[i], sample))
            owners += [(i, end - 1)] if sample else []
            fed[i] = end
        logits = model.forward(build_forward_batch(steps, model.block_size))
        got.update(zip(owners, logits))
    return got


def scattered_tables(lengths, block_size, num_blocks, seed):
    """Disjoint block tables drawn from a shuffled permutation of the whole cache."""
    free = list(np.random.default_rng(seed).permutation(num_blocks))
    return [[int(free.pop()) for _ in range(-(-n // block_size))] for n in lengths]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    return build_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "gemma3"])
def new_family_case(request, tmp_path_factory):
    return build_case(request.param, tmp_path_factory)


def build_case(family, tmp_path_factory):
    """A transformers model of `family`, its logits on four sequences, and its unquantized engine tensors."""
    directory = tmp_path_factory.mktemp(family)
    hf_model = make_hf_model(family, directory)
    rng = np.random.default_rng(1)
    sequences = [rng.integers(3, VOCAB, n + NUM_DECODE).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        want = [hf_model(torch.tensor([s])).logits[0].numpy() for s in sequences]   # [len, V] each
    src = import_hf(directory)
    encoded, _, _ = quantize_model(src.config, src.tensors, QuantOptions(method="none"))
    SOURCES[family] = src
    return family, src.config, encoded, sequences, want


SOURCES = {}        # family -> the imported SourceModel of family_case


def import_hf_cached(case):
    return SOURCES[case[0]]


@pytest.mark.parametrize("chunk", [None, 3])
def test_matches_transformers_prefill_then_decode(family_case, chunk):
    family, config, encoded, sequences, want = family_case
    num_blocks = 64
    model = ReferenceModel(config, encoded, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    tables = scattered_tables([len(s) for s in sequences], BLOCK_SIZE, num_blocks, seed=7)
    assert any(t != sorted(t) for t in tables)                          # really scattered
    got = run_reference(model, sequences, PROMPT_LENS, chunk, tables)
    assert len(got) == len(sequences) * (NUM_DECODE + 1)
    worst = max(float(np.max(np.abs(logits - want[i][pos]))) for (i, pos), logits in got.items())
    scale = max(float(np.max(np.abs(w))) for w in want)
    assert scale > 1.0, f"{family}: logits too flat to test anything (max |logit| {scale})"
    assert worst < 1e-4, f"{family}: max abs logit difference {worst:.2e} (logits up to {scale:.1f})"


def test_each_family_exercises_its_quirk(family_case):
    """The comparison above only means something if the quirk reached the config."""
    family, config, *_ = family_case
    quirks = {"llama": config.rope_scaling is None and config.num_kv_heads == 2,
              "llama3": config.rope_scaling is not None and config.rope_scaling.original_max_position_embeddings == 32,
              "mistral": config.sliding_window == 7 and config.num_kv_heads == 1,   # windows of 7 < 45 positions
              "qwen2": config.qkv_bias and config.tie_word_embeddings,
              "gemma": config.activation == "gelu_tanh" and config.embedding_multiplier == 8.0
                       and config.head_dim * config.num_heads != config.hidden_size,
              "qwen3": config.qk_norm and not config.post_norms and config.head_dim == 32,
              "gemma2": config.post_norms and config.sliding_layers == (True, False) and config.sliding_window == 6
                        and config.attn_logit_softcap == 3.0 and config.final_logit_softcap == 8.0
                        and config.attn_scale == 24 ** -0.5,
              "gemma3": config.qk_norm and config.post_norms and config.rope_local_theta == 10000.0
                        and config.rope_theta == 1e6 and config.sliding_layers == (True, False)}
    assert quirks[family]


@pytest.mark.parametrize("chunk", [None, 3])
def test_c_backend_matches_the_reference_on_the_new_families(new_family_case, chunk):
    """Qwen3 and Gemma 2/3 imported from transformers: the C forward (INT4 and dense) against the
    reference, over sequences of 45 positions with Gemma's windows of 5 and 6."""
    from tokenwire.kernels import cpu
    family, config, encoded, sequences, want = new_family_case
    if not cpu.AVAILABLE:
        pytest.skip(f"C kernels not built: {cpu.IMPORT_ERROR}")
    src = import_hf_cached(new_family_case)
    for tensors in (encoded, quantize_model(config, src.tensors, QuantOptions(algorithm="rtn", group_size=32))[0]):
        tables = scattered_tables([len(s) for s in sequences], BLOCK_SIZE, 64, seed=3)
        ref = run_reference(ReferenceModel(config, tensors, block_size=BLOCK_SIZE, num_blocks=64),
                            sequences, PROMPT_LENS, chunk, tables)
        got = run_reference(cpu.create_model(config, tensors, block_size=BLOCK_SIZE, num_blocks=64),
                            sequences, PROMPT_LENS, chunk, tables)
        scale = max(1.0, max(float(np.max(np.abs(v))) for v in ref.values()))
        worst = max(float(np.max(np.abs(got[key] - ref[key]))) for key in ref)
        assert worst < 2e-5 * scale, f"{family}: C vs reference {worst:.2e} (logits up to {scale:.1f})"
