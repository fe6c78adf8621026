"""`tokenwire bench numerics`: what int8 activations cost in accuracy against the exact path.

    tokenwire bench numerics [--stories DIR] [--max-len 256] [--greedy 200] [--json FILE]

The C kernels multiply INT4 weights with activations either exactly (`fp32`: the products
agree with x @ dequantized W to float32 rounding) or quantized per group of 64 to int8
(`int8`: llama.cpp's trade-off for its 4-bit products; kernels/cpu/README.md "Numerics").
Both run the same INT4 engine here, on the C forward, so the difference is the activations'
rounding alone. Per model it prints:
- perplexity over the package's evaluation text (engine_build/data/eval.txt, windows of
  --max-len tokens, each run from position 0): the exact path's, the int8 path's, and for a
  checkpoint with float weights the unquantized model's (the INT4 weights' own cost, for scale);
- top-1 agreement: the share of positions along that text where both paths pick the same
  next token;
- greedy: --greedy tokens from a prompt: top-1 agreement along the exact path's greedy
  continuation, and how many tokens the int8 path's own greedy run reproduces before it first
  differs.

Models: llama2.c's stories260K (a real trained checkpoint; --stories names its folder,
default the shared copy beside the repository) as INT4 g64 round-to-nearest (fp16 embedding),
and the embedded default model (random weights of SmolLM2-135M's layer shape:
a random Llama whose logits are nearly flat, the hard case for agreement).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..engine_build.calibration import default_eval_text, split_sequences
from ..engine_build.default_model import default_engine_path
from ..engine_build.llama2c import import_llama2c
from ..engine_build.quantize import QuantOptions, quantize_model
from ..engine_build.report import next_token_nll
from ..kernels import cpu
from ..kernels.cpu.model import CpuModel
from ..kernels.engine_format import load_engine
from ..kernels.model import ReferenceModel, greedy_generate, sequence_logits

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stories", type=Path, default=STORIES,
                        help="folder with llama2.c's stories260K.bin (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=256, help="evaluation window in tokens (default: %(default)s)")
    parser.add_argument("--greedy", type=int, default=200, help="greedy tokens compared (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def compare(name: str, config, tensors, tokenize, bos, args, float_tensors=None) -> dict:
    ids = tokenize(default_eval_text())
    sequences = [([bos] if bos is not None else []) + s for s in split_sequences(ids, args.max_len - 1)]
    prompt = ([bos] if bos is not None else []) + tokenize(PROMPT)
    blocks = -(-max(args.max_len, len(prompt) + args.greedy) // 16) + 1
    exact, int8 = (CpuModel(config, tensors, 16, blocks, activations=a) for a in ("fp32", "int8"))
    nll = {"exact": [], "int8": [], "float": []}
    agree = []
    for seq in sequences:
        le, lq = sequence_logits(exact, seq), sequence_logits(int8, seq)
        nll["exact"].append(next_token_nll(le, seq))
        nll["int8"].append(next_token_nll(lq, seq))
        agree.append(le[:-1].argmax(-1) == lq[:-1].argmax(-1))
        if float_tensors is not None:
            ref = ReferenceModel(config, float_tensors, 16, blocks)
            nll["float"].append(next_token_nll(sequence_logits(ref, seq), seq))
    want = greedy_generate(exact, prompt, args.greedy)
    ranked = sequence_logits(int8, prompt + want[:-1])[len(prompt) - 1:].argmax(-1)
    own = greedy_generate(int8, prompt, args.greedy)
    prefix = next((i for i, (a, b) in enumerate(zip(want, own)) if a != b), len(want))
    ppl = {k: float(np.exp(np.concatenate(v).mean())) for k, v in nll.items() if v}
    row = {"model": name, "tokens": int(sum(len(s) - 1 for s in sequences)), "perplexity": ppl,
           "top1_agreement": float(np.concatenate(agree).mean()),
           "greedy_tokens": len(want), "greedy_top1_agreement": float(np.mean(ranked == np.asarray(want))),
           "greedy_identical_prefix": prefix}
    print(f"\n== {name}: {row['tokens']} evaluation tokens in windows of {args.max_len}; {cpu.isa()} kernels")
    extra = f", unquantized float weights {ppl['float']:.4f}" if "float" in ppl else ""
    print(f"   perplexity: exact {ppl['exact']:.4f}, int8 activations {ppl['int8']:.4f} "
          f"({100 * (ppl['int8'] / ppl['exact'] - 1):+.2f}%){extra}")
    print(f"   top-1 agreement along the text: {100 * row['top1_agreement']:.2f}%")
    print(f"   greedy, {len(want)} tokens: top-1 agreement along the exact path {100 * row['greedy_top1_agreement']:.1f}%, "
          f"int8's own run identical for the first {prefix}")
    return row


def run(args) -> int:
    if not cpu.AVAILABLE:
        raise SystemExit(f"tokenwire bench numerics: the C kernels are not built ({cpu.IMPORT_ERROR})")
    if args.max_len < 2 or args.greedy < 1:
        raise SystemExit("tokenwire bench numerics: --max-len must be >= 2 and --greedy >= 1")
    rows = []
    if (args.stories / "stories260K.bin").exists():
        src = import_llama2c(args.stories / "stories260K.bin")
        tok = Tokenizer.from_str(src.tokenizer.files["tokenizer.json"].decode("utf-8"))
        floats = quantize_model(src.config, src.tensors, QuantOptions(method="none"))[0]
        tensors = quantize_model(src.config, src.tensors, QuantOptions(algorithm="rtn"))[0]
        rows.append(compare("stories260K (INT4 g64 round-to-nearest, fp16 embedding)", src.config, tensors,
                            lambda t: tok.encode(t, add_special_tokens=False).ids, src.tokenizer.bos_token_id,
                            args, floats))
    else:
        print(f"stories260K not found at {args.stories}: skipped", file=sys.stderr)
    engine = load_engine(default_engine_path())
    rows.append(compare("the embedded default model (random weights, SmolLM2-135M layer shape)", engine.config,
                        engine.tensors, lambda t: engine.tokenizer.encode(t, add_special_tokens=False).ids,
                        engine.bos_token_id, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
