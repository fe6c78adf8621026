"""The group size x algorithm table of the quantizer's docstring (quantize.py):

    python -m tokenwire.engine_build.sweep CHECKPOINT

quantizes one checkpoint every way (group sizes 32/64/128, every algorithm), calibrated on
the shipped calibration text and scored on the shipped eval text with report.py's
`evaluate_model`, and prints one row per setting.
"""

import argparse
from typing import Sequence

from tokenizers import Tokenizer

from ..core.config import ModelConfig
from .build import open_source
from .calibration import (
    capture_activations,
    default_calibration_text,
    default_eval_text,
    split_sequences,
)
from .quantize import QuantOptions, dense_engine_tensors, encode_model
from .report import evaluate_model


def sweep(config: ModelConfig, tensors, calibration: Sequence[Sequence[int]], eval_sequences, prompt_ids,
          group_sizes=(32, 64, 128), algorithms=("rtn", "clip", "awq", "gptq", "awq_gptq"), symmetric=False,
          num_greedy: int = 200, progress: bool = False) -> list:
    """Quantize `tensors` (canonical float, engine_build/source.py) every way. -> [row dict]"""
    fp = dense_engine_tensors(config, tensors)
    acts = capture_activations(config, fp, calibration, progress)       # once for the whole grid
    rows = []
    for g in group_sizes:
        for algorithm in algorithms:
            options = QuantOptions(group_size=g, algorithm=algorithm, symmetric=symmetric)
            encoded, _, report = encode_model(config, tensors, options, acts, progress)
            ev = evaluate_model(config, fp, encoded, eval_sequences, prompt_ids, num_greedy, progress)
            rows.append({"group_size": g, "algorithm": algorithm, "bits_per_weight": 4 + 32 / g,
                         "weight_rel_error": report.mean_weight_error(), "output_rel_error": report.mean_output_error(),
                         **ev.to_dict()})
    return rows


def format_sweep(rows: list) -> str:
    head = (f"{'G':>4} {'algorithm':<9} {'bits/w':>6} {'weight err':>10} {'output err':>10} {'ppl fp':>8} "
            f"{'ppl q':>8} {'ppl +%':>7} {'top1 agree':>10} {'cosine':>8} {'greedy agree':>12} {'prefix':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['group_size']:>4} {r['algorithm']:<9} {r['bits_per_weight']:>6.2f} {r['weight_rel_error']:>10.4f} "
                     f"{r['output_rel_error']:>10.4f} {r['fp_perplexity']:>8.3f} {r['quant_perplexity']:>8.3f} "
                     f"{100 * r['perplexity_change']:>7.2f} {r['top1_agreement']:>10.3f} {r['logit_cosine']:>8.5f} "
                     f"{r['greedy_agreement']:>5}/{r['num_greedy']:<6} {r['greedy_prefix']:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the sweep for one checkpoint: calibrated on the shipped calibration text, scored on the shipped eval text."""

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("source", help="HF model directory or llama2.c checkpoint")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--window", type=int, default=512, help="tokens per calibration/eval sequence")
    parser.add_argument("--sym", action="store_true")
    args = parser.parse_args(argv)
    src = open_source(args.source)
    tok = Tokenizer.from_str(src.tokenizer.files["tokenizer.json"].decode("utf-8"))
    window = min(args.window, src.config.max_position_embeddings)
    calibration = split_sequences(tok.encode(default_calibration_text(), add_special_tokens=False).ids, window)
    eval_sequences = split_sequences(tok.encode(default_eval_text(), add_special_tokens=False).ids, window)
    prompt = tok.encode(args.prompt, add_special_tokens=False).ids
    prompt = ([src.tokenizer.bos_token_id] if src.tokenizer.add_bos else []) + prompt
    print(format_sweep(sweep(src.config, src.tensors, calibration, eval_sequences, prompt, symmetric=args.sym,
                             progress=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
