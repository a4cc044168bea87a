"""The unclamped log-ratio extremes and the share of far tokens in every batch's metrics,
checked against plain loops in float64 (issue 45: a token at −37 showed as −20)."""

import math

import pytest
import torch

from asyncfp8.correction import get_correction
from asyncfp8.correction.metrics import FAR_LOG_RATIO


def reference(learner, rollout, mask):
    """(min, max, share of |log ρ| > 5) over real tokens, one token at a time in float64."""
    ratios = [
        float(learner[b][t]) - float(rollout[b][t])
        for b in range(len(mask))
        for t in range(len(mask[b]))
        if mask[b][t]
    ]
    if not ratios:
        return 0.0, 0.0, 0.0
    far = sum(1 for r in ratios if abs(r) > FAR_LOG_RATIO)
    return min(ratios), max(ratios), far / len(ratios)


def metrics_of(learner, rollout, mask):
    out = get_correction("token_tis")(
        torch.tensor(learner, dtype=torch.float64).float(),
        torch.tensor(rollout).float(),
        torch.tensor(mask),
    )
    return out.metrics


def test_a_token_at_minus_37_reads_minus_37_not_the_clamp():
    # the engine sampled the first token at log p −0.00; the learner now gives it −37
    learner = [[-37.0, -1.0, -2.0], [-0.5, -0.25, -9.0]]
    rollout = [[0.0, -1.5, -2.0], [-0.5, -0.5, -1.0]]
    mask = [[True, True, True], [True, True, False]]  # −9 vs −1 is padding: not counted
    metrics = metrics_of(learner, rollout, mask)
    low, high, far = reference(learner, rollout, mask)
    assert low == -37.0
    assert metrics["mismatch/log_ratio_min"] == pytest.approx(low, abs=1e-5)
    assert metrics["mismatch/log_ratio_max"] == pytest.approx(high, abs=1e-5)
    assert metrics["mismatch/frac_abs_log_ratio_gt5"] == pytest.approx(far) == 1 / 5
    # the clamped view the other metrics keep
    assert metrics["mismatch/log_ratio_abs_max"] == pytest.approx(20.0)


def test_large_positive_ratio_and_random_batches_match_the_loops():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        rollout = -torch.rand(4, 7, generator=generator, dtype=torch.float64) * 3
        learner = rollout + torch.randn(4, 7, generator=generator, dtype=torch.float64) * 8
        learner = learner.clamp(max=0.0)
        mask = torch.rand(4, 7, generator=generator) > 0.3
        metrics = metrics_of(learner.tolist(), rollout.tolist(), mask.tolist())
        low, high, far = reference(learner.tolist(), rollout.tolist(), mask.tolist())
        # float32 inputs: within float32 rounding of the float64 reference
        assert metrics["mismatch/log_ratio_min"] == pytest.approx(low, abs=1e-5)
        assert metrics["mismatch/log_ratio_max"] == pytest.approx(high, abs=1e-5)
        assert metrics["mismatch/frac_abs_log_ratio_gt5"] == pytest.approx(far)


def test_an_infinite_log_prob_reads_as_the_raw_bound_and_no_tokens_read_zero():
    metrics = metrics_of([[-math.inf, -1.0]], [[-0.1, -1.0]], [[True, True]])
    assert metrics["mismatch/log_ratio_min"] == -1e4
    assert metrics["mismatch/frac_abs_log_ratio_gt5"] == 0.5
    empty = metrics_of([[-1.0]], [[-2.0]], [[False]])
    assert empty["mismatch/log_ratio_min"] == empty["mismatch/log_ratio_max"] == 0.0
    assert empty["mismatch/frac_abs_log_ratio_gt5"] == 0.0


def test_step_metrics_carry_them_for_all_tokens_and_the_current_version_only():
    from asyncfp8.sync import Trajectory
    from asyncfp8.train.batches import batch_tensors
    from asyncfp8.train.step_metrics import fresh_mismatch

    fresh = Trajectory([1, 2], [3, 4], [0.0, -0.5], [2, 2], 1.0, "0")
    stale = Trajectory([1, 2], [5], [-0.1], [1], 0.0, "1")
    batch = batch_tensors([fresh, stale], 0)
    learner_logp = torch.tensor([[-37.0, -0.5], [-30.0, 0.0]])
    measured = fresh_mismatch(learner_logp, batch, version=2)
    # the stale sample's −29.9 is not the current version's
    assert measured["fresh/log_ratio_min"] == pytest.approx(-37.0)
    assert measured["fresh/log_ratio_max"] == pytest.approx(0.0)
    assert measured["fresh/frac_abs_log_ratio_gt5"] == pytest.approx(0.5)
