"""tokenwire's greedy tokens on a Q4_0 GGUF against llama.cpp's on the very same file (issue 17).

Runs where llama-cpp-python is installed (the optional `llama` extra, a source build; never in
CI, where it skips saying so). The file is written by bench/gguf_random.py; llama.cpp reads it,
tokenwire imports it (engine_build/gguf_import.py keeps the Q4_0 codes and scales as they are).

The two do not compute the same arithmetic: llama.cpp multiplies the Q4_0 weights with
activations rounded to 8 bits (q8_0) and keeps its KV cache in f16; tokenwire's reference
forward runs float32 on the same dequantized weights. So the tokens agree until the first
near-tie, and what the test holds them to is that every difference is of that size: the
logits agree to a few percent of their spread at every step (a layout or RoPE mistake
moves them by their whole spread), and the first divergence, reported with its logit gap,
happens where the two best tokens are closer than the engines' own logit difference there.
Teacher-forced: tokenwire scores llama.cpp's sequence, so up to the first divergence its
greedy tokens are llama.cpp's.
"""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the optional `llama` extra, "
                                        "built from source: pip install '.[llama]')")

from tokenwire.bench import vs_llama
from tokenwire.core.config import ModelConfig
from tokenwire.kernels.engine_format import load_engine
from tokenwire.kernels.model import ReferenceModel, sequence_logits

NUM_TOKENS = 64
SHAPE = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
             rms_norm_eps=1e-6, rope_theta=10000.0)
MAX_MEDIAN_LOGIT_DIFF = 0.10        # of a step's logit spread (max - min); measured: ~0.05 median, ~0.08 p90


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_on_one_q4_0_gguf_agree_with_llama_cpp_up_to_a_near_tie(tmp_path: Path, tied: bool):
    config = ModelConfig.from_dict(dict(SHAPE, tie_word_embeddings=tied))
    path, engine_dir = vs_llama.build_pair(config, "cmp", tmp_path, log=lambda line: None)
    llama = vs_llama.LlamaCpp(path, threads=2, context=128, max_batch=1)
    try:
        prompt = [1] + list(range(300, 316))
        tokens, llama_logits = llama.greedy(prompt, NUM_TOKENS)
    finally:
        llama.close()
    engine = load_engine(engine_dir)
    model = ReferenceModel(engine.config, engine.tensors, block_size=16, num_blocks=16)
    ours = sequence_logits(model, prompt + tokens)[len(prompt) - 1:len(prompt) - 1 + NUM_TOKENS]

    spread = ours.max(-1) - ours.min(-1)
    diff = np.abs(ours - llama_logits).max(-1)
    ours_ids = ours.argmax(-1)
    first = next((i for i in range(NUM_TOKENS) if ours_ids[i] != tokens[i]), None)
    gap = None if first is None else float(ours[first, ours_ids[first]] - ours[first, tokens[first]])
    print(f"\ntied={tied}: {NUM_TOKENS} greedy tokens; logits differ by {np.median(diff / spread):.3f} of their spread "
          f"(median over steps; max {np.max(diff / spread):.3f}); first divergence: "
          + ("none" if first is None else f"token {first} (tokenwire {ours_ids[first]}, llama.cpp {tokens[first]}), "
             f"logit gap {gap:.4f} against an engine difference of {diff[first]:.4f} at that step"))

    assert np.median(diff / spread) < MAX_MEDIAN_LOGIT_DIFF
    if first is not None:
        assert gap <= diff[first], "a divergence wider than the engines' logit difference there: not rounding"
