"""INT4 on tiny random-weight models of every family (made with transformers, imported with
engine_build/hf.py): top-1 agreement and logit cosine against the float32 model, and the
error-reducing algorithm against round-to-nearest on the same seed.

The models use initializer_range 0.15 (test_forward_hf.py), so their logits spread over
several units and top-1 agreement is not a coin flip over near-uniform logits. Random
weights have no outlier channels, so AWQ's gain here is small (a few percent of output
error); the meaningful INT4 figures come from the trained stories260K (test_golden_stories.py)."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_forward_hf import FAMILIES, VOCAB, make_hf_model       # noqa: E402
from tokenwire.engine_build.calibration import capture_activations  # noqa: E402
from tokenwire.engine_build.hf import import_hf  # noqa: E402
from tokenwire.engine_build.quantize import QuantOptions, dense_engine_tensors, encode_model  # noqa: E402
from tokenwire.engine_build.report import evaluate_model  # noqa: E402


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int4_agreement_and_awq_beats_rtn(family, tmp_path):
    make_hf_model(family, tmp_path, seed=3)
    src = import_hf(tmp_path)
    rng = np.random.default_rng(11)
    calibration = [rng.integers(3, VOCAB, 96).tolist() for _ in range(4)]
    eval_seqs = [rng.integers(3, VOCAB, 64).tolist() for _ in range(3)]
    fp = dense_engine_tensors(src.config, src.tensors)
    acts = capture_activations(src.config, fp, calibration)
    results = {}
    for algorithm in ("rtn", "awq"):
        encoded, _, report = encode_model(src.config, src.tensors, QuantOptions(group_size=32, algorithm=algorithm), acts)
        results[algorithm] = (report, evaluate_model(src.config, fp, encoded, eval_seqs, [1, 5, 9], num_greedy=24))
    (rtn_report, rtn), (awq_report, awq) = results["rtn"], results["awq"]
    print(f"{family}: top-1 agreement rtn {rtn.top1_agreement:.3f} awq {awq.top1_agreement:.3f}, "
          f"logit cosine rtn {rtn.logit_cosine:.5f} awq {awq.logit_cosine:.5f}, "
          f"output rel err rtn {rtn_report.mean_output_error():.4f} awq {awq_report.mean_output_error():.4f}")
    assert awq_report.mean_output_error() < rtn_report.mean_output_error()
    # Sanity bounds, well under the measured figures (awq: cosine 0.94-0.98, top-1 0.57-0.84 on
    # random eval tokens, where even a random model's top logits sit close together; along the
    # float model's own greedy path agreement is 20+/24). They catch a broken encoding, which
    # lands near cosine 0 and top-1 1/256.
    assert awq.logit_cosine > 0.9 and awq.top1_agreement > 0.45 and awq.greedy_agreement >= 12, awq
