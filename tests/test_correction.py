import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncfp8.correction import (
    MethodResult,
    build_correction,
    get_correction,
    register_correction,
    registered_corrections,
)

LN = math.log
SEQUENCE_METHODS = ["seq_tis", "seq_mis"]
ALL_METHODS = registered_corrections()


def batch(log_ratios, mask=None, rollout=-5.0):
    """learner/rollout logprobs whose difference is exactly the given log-ratios."""
    delta = torch.tensor(log_ratios, dtype=torch.float64).float()
    rollout_logp = torch.full_like(delta, rollout)
    mask = (
        torch.ones_like(delta, dtype=torch.bool)
        if mask is None
        else torch.tensor(mask, dtype=torch.bool)
    )
    return rollout_logp + delta, rollout_logp, mask


def close(actual, expected):
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6
    )


# --- hand-computed values -------------------------------------------------------------


def test_token_tis_truncates_at_the_cap():
    out = get_correction("token_tis", threshold=2.0)(*batch([[LN(0.5), LN(3.0), 0.0]]))
    close(out.weights, [[0.5, 2.0, 1.0]])
    assert out.mask.all()
    assert out.metrics["correction/frac_clipped"] == pytest.approx(1 / 3)


def test_token_mis_masks_outside_the_band():
    out = get_correction("token_mis", lower=0.5, upper=5.0)(
        *batch([[LN(0.25), LN(3.0), LN(6.0), LN(0.5)]])
    )
    close(out.weights, [[0.0, 3.0, 0.0, 0.5]])
    assert out.mask.tolist() == [[False, True, False, True]]
    assert out.metrics["correction/frac_masked"] == pytest.approx(0.5)


def test_sequence_is_uses_the_product_of_ratios():
    ratios = [[LN(2.0), LN(3.0)], [LN(0.5), LN(0.5)], [LN(1.5), 0.0]]
    tis = get_correction("seq_tis", threshold=2.0)(*batch(ratios))
    close(tis.weights, [[2.0, 2.0], [0.25, 0.25], [1.5, 1.5]])
    mis = get_correction("seq_mis", lower=0.5, upper=5.0)(*batch(ratios))
    assert mis.mask.tolist() == [[False, False], [False, False], [True, True]]
    close(mis.weights, [[0.0, 0.0], [0.0, 0.0], [1.5, 1.5]])
    assert mis.metrics["correction/frac_seq_rejected"] == pytest.approx(2 / 3)


def test_padding_never_enters_a_sequence_product():
    ratios = [[LN(2.0), 50.0]]  # the padded token's log-ratio would dominate
    out = get_correction("seq_tis", threshold=10.0)(*batch(ratios, mask=[[1, 0]]))
    close(out.weights, [[2.0, 0.0]])


def test_sequence_methods_clamp_the_summed_log_ratio_not_each_token():
    # One token at +45 and the rest summing to -25: the sequence log-ratio is +20, so the
    # sequence is far above any cap. Clamping each token to ±20 first would give e^-5.
    ratios = [[45.0, -10.0, -15.0]]
    data = batch(ratios, rollout=-100.0)
    close(get_correction("seq_tis", threshold=2.0)(*data).weights, [[2.0] * 3])
    assert not get_correction("seq_mis", upper=5.0)(*data).mask.any()


def reference_sequence_weights(log_ratios, mask, method, **params):
    """Per sequence with Python floats: sum (or mean) of the raw token log-ratios of the
    real tokens, clamped to ±20, then the method's weight and whether it keeps it."""
    out = []
    for row, keep_row in zip(log_ratios, mask, strict=True):
        real = [r for r, m in zip(row, keep_row, strict=True) if m]
        total = max(-20.0, min(20.0, sum(real)))
        if method == "seq_tis":
            out.append((min(math.exp(total), params["threshold"]), True))
        elif method == "seq_mis":
            ratio = math.exp(total)
            out.append((ratio, params["lower"] <= ratio <= params["upper"]))
        else:  # geo_rs
            mean = max(-20.0, min(20.0, sum(real) / max(len(real), 1)))
            out.append((1.0, params["lower"] <= math.exp(mean) <= params["upper"]))
    return out


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("seq_tis", {"threshold": 3.0}),
        ("seq_mis", {"lower": 0.2, "upper": 4.0}),
        ("geo_rs", {"lower": 0.8, "upper": 1.25}),
    ],
)
def test_sequence_methods_against_an_independent_computation(method, params):
    generator = torch.Generator().manual_seed(7)
    # Mostly small log-ratios, some beyond the ±20 clamp, so that clamping order matters.
    log_ratios = torch.randn(64, 9, generator=generator, dtype=torch.float64)
    spikes = torch.rand(64, 9, generator=generator) < 0.1
    log_ratios[spikes] *= 40
    mask = torch.rand(64, 9, generator=generator) > 0.2
    learner, rollout, _ = batch(log_ratios.tolist(), rollout=-400.0)
    out = get_correction(method, **params)(learner, rollout, mask)
    # The reference starts from the float32 log-probs the correction was given.
    rows = (learner.double() - rollout.double()).tolist()
    expected = reference_sequence_weights(rows, mask.tolist(), method, **params)
    for i, (weight, kept) in enumerate(expected):
        real = mask[i]
        if not real.any():
            continue
        assert bool(out.mask[i, real].all()) == kept, (i, rows[i])
        if kept:
            torch.testing.assert_close(
                out.weights[i, real].double(),
                torch.full((int(real.sum()),), weight, dtype=torch.float64),
                rtol=1e-4,
                atol=0,
            )


def test_geometric_rejection_is_length_neutral():
    ratios = [[LN(2.0), LN(0.5)], [LN(1.5), 0.0]]  # geometric means 1 and sqrt(1.5)
    out = get_correction("geo_rs", lower=0.9, upper=1.1)(*batch(ratios))
    assert out.mask.tolist() == [[True, True], [False, False]]
    close(out.weights, [[1.0, 1.0], [0.0, 0.0]])


def test_kl_estimators_token_level():
    # δ = ln 2: k1 = -0.6931, k2 = 0.2402, k3 = 2 - 1 - 0.6931 = 0.3069
    data = batch([[LN(2.0)]])
    assert not get_correction("token_k3", upper=0.30)(*data).mask.any()
    assert get_correction("token_k3", upper=0.31)(*data).mask.all()
    assert not get_correction("token_k2", upper=0.24)(*data).mask.any()
    assert get_correction("token_k2", upper=0.25)(*data).mask.all()
    assert not get_correction("token_k1", lower=-0.6, upper=1.0)(*data).mask.any()
    assert get_correction("token_k1", lower=-0.7, upper=1.0)(*data).mask.all()


def test_kl_estimators_sequence_levels():
    data = batch([[LN(2.0), 0.0]])  # k3 per token: 0.3069, 0 -> sum .3069, mean .1534, max .3069
    assert not get_correction("seq_sum_k3", upper=0.2)(*data).mask.any()
    assert get_correction("seq_mean_k3", upper=0.2)(*data).mask.all()
    assert not get_correction("seq_max_k3", upper=0.2)(*data).mask.any()
    close(get_correction("seq_mean_k3", upper=0.2)(*data).weights, [[1.0, 1.0]])


def test_is_method_combined_with_rejection_through_config_alone():
    ratios = [[LN(3.0), 0.0], [LN(1.01), LN(0.99)]]
    out = get_correction(
        "token_tis", threshold=2.0, reject=[{"name": "seq_mean_k3", "upper": 0.05}]
    )(*batch(ratios))
    assert out.mask.tolist() == [[False, False], [True, True]]
    close(out.weights, [[0.0, 0.0], [1.01, 0.99]])


def test_stale_tis_cap_shrinks_with_staleness():
    learner, rollout, mask = batch([[LN(10.0)] * 3])
    versions = torch.tensor([[7, 6, 5]])
    out = get_correction("stale_tis", threshold=3.0, decay=0.5)(learner, rollout, mask, versions, 7)
    close(out.weights, [[3.0, 2.0, 1.5]])
    assert out.metrics["staleness/mean"] == pytest.approx(1.0)
    assert out.metrics["staleness/max"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs per-token `versions`"):
        get_correction("stale_tis")(learner, rollout, mask)


def test_mismatch_metrics_by_hand():
    out = get_correction("none")(*batch([[LN(2.0), LN(0.5), 7.0]], mask=[[1, 1, 0]]))
    # k1 = mean(-δ) = 0; k3 = mean(ρ - 1 - δ) = ((2 - 1 - ln2) + (0.5 - 1 + ln2)) / 2 = 0.25
    assert out.metrics["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-6)
    assert out.metrics["mismatch/kl_k3"] == pytest.approx(0.25, rel=1e-5)
    assert out.metrics["mismatch/chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-5)
    assert out.metrics["mismatch/chi2_seq"] == pytest.approx(0.0, abs=1e-5)  # product 2 * 0.5 = 1
    tis = get_correction("token_tis", threshold=3.0)(*batch([[0.0, LN(3.0)]]))
    assert tis.metrics["correction/ess"] == pytest.approx(16 / (2 * 10), rel=1e-5)  # weights 1, 3
    assert tis.metrics["correction/weight_mean"] == pytest.approx(2.0, rel=1e-5)
    assert tis.metrics["correction/weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert tis.metrics["correction/weight_min"] == pytest.approx(1.0, rel=1e-5)


def test_max_staleness_drops_and_counts():
    learner, rollout, mask = batch([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    versions = torch.tensor([[10, 10], [8, 9], [6, 10]])  # staleness 0, 2, 4 (oldest token)
    out = get_correction("token_tis", max_staleness=2)(learner, rollout, mask, versions, 10)
    assert out.mask.tolist() == [[True, True], [True, True], [False, False]]
    assert out.metrics["staleness/frac_dropped"] == pytest.approx(1 / 3)


# --- properties ---------------------------------------------------------------------------

shapes = st.tuples(st.integers(1, 4), st.integers(1, 6))


@st.composite
def logprob_batches(draw, scale=30.0):
    b, t = draw(shapes)
    floats = st.floats(-scale, 0.0, allow_nan=False, width=32)
    learner = torch.tensor(draw(st.lists(floats, min_size=b * t, max_size=b * t))).view(b, t)
    rollout = torch.tensor(draw(st.lists(floats, min_size=b * t, max_size=b * t))).view(b, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    return learner, rollout, mask


@pytest.mark.parametrize("name", ALL_METHODS)
@given(data=logprob_batches())
@settings(max_examples=40, deadline=None)
def test_identical_logprobs_change_nothing(name, data):
    learner, _, mask = data
    versions = torch.zeros_like(learner, dtype=torch.long)
    out = get_correction(name)(learner, learner.clone(), mask, versions, 0)
    assert torch.equal(out.mask, mask)
    assert torch.equal(out.weights, mask.float())
    assert out.metrics["mismatch/kl_k1"] == 0.0 and out.metrics["mismatch/kl_k3"] == 0.0


@pytest.mark.parametrize("name", ALL_METHODS)
@given(data=logprob_batches(scale=1e6))
@settings(max_examples=40, deadline=None)
def test_masks_never_resurrect_padding_and_weights_stay_finite(name, data):
    learner, rollout, mask = data
    versions = torch.zeros_like(learner, dtype=torch.long)
    out = get_correction(name)(learner, rollout, mask, versions, 0)
    assert not (out.mask & ~mask).any()
    assert torch.isfinite(out.weights).all()
    assert (out.weights[~out.mask] == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", SEQUENCE_METHODS)
@given(data=logprob_batches(scale=3.0))
@settings(max_examples=40, deadline=None)
def test_sequence_methods_give_one_value_per_sequence(name, data):
    out = get_correction(name)(*data)
    for weights, kept in zip(out.weights, out.mask, strict=True):
        assert weights[kept].unique().numel() <= 1


# --- bad input ------------------------------------------------------------------------------


def test_bad_inputs_are_clear_value_errors():
    learner, rollout, mask = batch([[0.0, 0.0]])
    corr = get_correction("token_tis")
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        corr(learner, rollout[:, :1], mask)
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        corr(learner[0], rollout[0], mask[0])
    nan = learner.clone()
    nan[0, 1] = float("nan")
    with pytest.raises(
        ValueError, match=r"learner_logp is NaN at 1 unmasked positions \(first at \[0, 1\]\)"
    ):
        corr(nan, rollout, mask)
    corr(nan, rollout, torch.tensor([[True, False]]))  # NaN under padding is ignored
    with pytest.raises(ValueError, match="positive log-probabilities"):
        corr(learner + 6, rollout, mask)
    with pytest.raises(ValueError, match="mask must be bool or hold only 0 and 1"):
        corr(learner, rollout, torch.tensor([[2, 1]]))


def test_bad_configuration_is_a_clear_value_error():
    with pytest.raises(
        ValueError, match=r"unknown correction 'token_tiss'; registered: .*token_tis"
    ):
        get_correction("token_tiss")
    with pytest.raises(
        ValueError, match=r"token_mis: lower \(5\.0\) must not exceed upper \(0\.5\)"
    ):
        get_correction("token_mis", lower=5.0, upper=0.5)
    with pytest.raises(
        ValueError, match=r"seq_mean_k3: lower \(1\.0\) must not exceed upper \(0\.1\)"
    ):
        get_correction("token_tis", reject=[{"name": "seq_mean_k3", "lower": 1.0, "upper": 0.1}])
    with pytest.raises(ValueError, match=r"token_tis: threshold must be > 0"):
        get_correction("token_tis", threshold=0)
    with pytest.raises(
        ValueError, match=r"correction 'token_tis' takes \['threshold'\], not \['upper'\]"
    ):
        get_correction("token_tis", upper=5)


def test_user_registered_method_gets_metrics_and_validation_for_free():
    @register_correction("test_half")
    def half(batch, factor: float = 0.5):
        return MethodResult(weights=torch.full_like(batch.log_ratio, factor), keep=batch.mask)

    out = get_correction("test_half")(*batch([[LN(2.0), 0.0]], mask=[[1, 0]]))
    close(out.weights, [[0.5, 0.0]])
    assert "mismatch/kl_k3" in out.metrics


def test_hydra_group_builds_every_method_with_overrides():
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="asyncfp8.conf"):
        cfg = compose(
            overrides=["+correction=token_mis", "correction.lower=0.25", "correction.upper=5"]
        )
        corr = build_correction(cfg.correction)
        assert corr.name == "token_mis" and corr.params == {"lower": 0.25, "upper": 5.0}
        cfg = compose(
            overrides=[
                "+correction=token_tis",
                "correction.reject=[{name:seq_mean_k3,upper:0.05}]",
                "correction.max_staleness=3",
                "correction.mode=bypass",
            ]
        )
        corr = build_correction(cfg.correction)
        assert [name for name, _ in corr.rejections] == ["seq_mean_k3"] and corr.max_staleness == 3
        for name in ALL_METHODS:
            if name.startswith("test_") or name == "icepop":
                continue
            assert (
                build_correction(compose(overrides=[f"+correction={name}"]).correction).name == name
            )
