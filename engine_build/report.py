"""How much quantization costs: the float model against the quantized one, both run by the
numpy reference forward (kernels/model.py).

Contract:
- `evaluate_model(config, fp_tensors, quant_tensors, eval_sequences, prompt_ids, num_greedy)`
  -> `Evaluation`: perplexity of both on a text, teacher-forced top-1 agreement and logit
  cosine on that text, and greedy agreement from a prompt. Tensors are engine tensors
  (what `quantize_model` returns; method "none" for the float side).
- Per-tensor relative errors ||W - W_hat|| / ||W|| are measured where the weights are
  encoded (quantize.py's QuantReport); sweep.py runs the whole grid of group sizes x
  algorithms for the table in the quantizer's docstring.
"""

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
from tqdm import tqdm

from ..core.config import ModelConfig
from ..kernels.model import ReferenceModel, greedy_generate, sequence_logits


@dataclass
class Evaluation:
    num_eval_tokens: int            # tokens predicted (all but the first of each sequence)
    fp_perplexity: float
    quant_perplexity: float
    top1_agreement: float           # fraction of eval positions where both argmaxes agree
    logit_cosine: float             # mean cosine similarity of the two logit rows over eval positions
    num_greedy: int                 # greedy tokens the float model generated from the prompt
    greedy_agreement: int           # of those, how many the quantized model also ranks first (same prefix fed)
    greedy_prefix: int              # leading tokens identical when each model generates on its own

    @property
    def perplexity_change(self) -> float:
        return self.quant_perplexity / self.fp_perplexity - 1.0

    def to_dict(self) -> dict:
        return dict(asdict(self), perplexity_change=self.perplexity_change)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def next_token_nll(logits: np.ndarray, token_ids: Sequence[int]) -> np.ndarray:
    """logits [T, V] of one sequence -> float64 [T - 1], -log p(token t+1 | tokens <= t)."""
    targets = np.asarray(token_ids[1:])
    return -log_softmax(logits[:-1])[np.arange(len(targets)), targets]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)


def evaluate_model(config: ModelConfig, fp_tensors, quant_tensors, eval_sequences: Sequence[Sequence[int]],
                   prompt_ids: Optional[Sequence[int]] = None, num_greedy: int = 200,
                   progress: bool = False) -> Evaluation:
    """Both models over `eval_sequences` (each run from position 0), then greedy from `prompt_ids`."""
    longest = max([len(s) for s in eval_sequences] + [len(prompt_ids or ()) + num_greedy])
    fp, quant = (ReferenceModel(config, t, block_size=16, num_blocks=-(-longest // 16)) for t in (fp_tensors, quant_tensors))
    nll_fp, nll_q, agree, cosine = [], [], [], []
    for seq in tqdm(eval_sequences, desc="perplexity", unit="seq", disable=not progress):
        lf, lq = sequence_logits(fp, seq), sequence_logits(quant, seq)
        nll_fp.append(next_token_nll(lf, seq))
        nll_q.append(next_token_nll(lq, seq))
        agree.append(lf[:-1].argmax(-1) == lq[:-1].argmax(-1))
        cosine.append(cosine_rows(lf[:-1], lq[:-1]))
    nll_fp, nll_q = np.concatenate(nll_fp), np.concatenate(nll_q)
    greedy = greedy_agreement(fp, quant, prompt_ids, num_greedy) if prompt_ids else (0, 0, 0)
    return Evaluation(len(nll_fp), float(np.exp(nll_fp.mean())), float(np.exp(nll_q.mean())),
                      float(np.concatenate(agree).mean()), float(np.concatenate(cosine).mean()), *greedy)


def greedy_agreement(fp: ReferenceModel, quant: ReferenceModel, prompt_ids, num_greedy: int) -> tuple:
    """-> (num_greedy, agreeing top-1 along the float model's path, identical free-running prefix)."""
    want = greedy_generate(fp, prompt_ids, num_greedy)
    path = list(prompt_ids) + want[:-1]
    ranked = sequence_logits(quant, path)[len(prompt_ids) - 1:].argmax(-1)        # [num_greedy]
    own = greedy_generate(quant, prompt_ids, num_greedy)
    prefix = next((i for i, (a, b) in enumerate(zip(want, own)) if a != b), len(want))
    return len(want), int(np.sum(ranked == np.asarray(want))), prefix
