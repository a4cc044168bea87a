"""Rejection that does not starve (asyncfp8/correction/calibration.py): bounds calibrated at
quantiles of the measured mismatch, the starved-update rule, and bad settings refused."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncfp8.correction import build_correction, get_correction, make_batch
from asyncfp8.correction.calibration import (
    BoundCalibration,
    calibration_values,
    check_rejection_settings,
    quantile_bounds,
    rejected_fraction,
    starved_scale,
)
from asyncfp8.correction.schema import REJECTION_KEYS, CorrectionConfig
from asyncfp8.train.step import TrainStep


def skewed_log_ratios(n: int, seed: int) -> np.ndarray:
    """A log-ratio distribution shaped like an FP8 engine's (docs/results.md): mostly
    slightly negative (the engine favours its own samples), a long lower tail."""
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [rng.normal(-0.01, 0.02, size=n - n // 5), -rng.exponential(0.15, size=n // 5)]
    )


@pytest.mark.parametrize("target", [0.01, 0.05, 0.3])
def test_quantile_bounds_match_numpy(target):
    values = skewed_log_ratios(1000, seed=1)
    low, high = np.quantile(values, [target / 2, 1 - target / 2])  # numpy's linear rule
    lower, upper = quantile_bounds(torch.from_numpy(values), target)
    assert lower == pytest.approx(np.exp(min(low, 0.0)), rel=1e-12)
    assert upper == pytest.approx(np.exp(max(high, 0.0)), rel=1e-12)
    outside = np.mean((values < np.log(lower)) | (values > np.log(upper)))
    assert rejected_fraction(torch.from_numpy(values), lower, upper) == pytest.approx(outside)
    assert abs(outside - target) <= 2 / len(values)  # distinct values: the target, to a value


def test_bounds_never_exclude_a_ratio_of_one():
    shifted = torch.linspace(0.1, 0.3, 101, dtype=torch.float64)  # every ρ above 1
    lower, upper = quantile_bounds(shifted, 0.1)
    assert lower == 1.0 and upper == pytest.approx(np.exp(np.quantile(shifted.numpy(), 0.95)))
    lower, upper = quantile_bounds(-shifted, 0.1)
    assert upper == 1.0 and lower == pytest.approx(np.exp(np.quantile(-shifted.numpy(), 0.05)))


def logprob_batch(seed: int, rows: int = 40, width: int = 12):
    """learner / rollout log-probs with ragged lengths; the log-ratios and mask as numpy."""
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    delta = torch.from_numpy(skewed_log_ratios(rows * width, seed)).reshape(rows, width)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[3] = False  # a sequence without a real token counts nowhere
    learner = (rollout + delta).clamp(max=0.0)
    true_delta = (learner - rollout).numpy()
    return learner.float(), rollout.float(), mask, true_delta, mask.numpy()


@pytest.mark.parametrize("name", ["token_mis", "seq_mis", "geo_rs"])
def test_calibration_values_are_each_methods_statistic(name):
    learner, rollout, mask, delta, np_mask = logprob_batch(seed=2)
    values = calibration_values(name, make_batch(learner, rollout, mask)).numpy()
    rows = [delta[i][np_mask[i]] for i in range(len(delta)) if np_mask[i].any()]
    expected = {
        "token_mis": np.concatenate(rows),
        "seq_mis": np.array([r.sum() for r in rows]),
        "geo_rs": np.array([r.mean() for r in rows]),
    }[name]
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["token_mis", "seq_mis", "geo_rs"])
def test_calibrated_correction_rejects_the_target_share_of_what_it_measured(name):
    learner, rollout, mask, delta, np_mask = logprob_batch(seed=3)
    correction = build_correction({"name": name, "lower": None, "upper": None})
    calibration = BoundCalibration(correction, target_rejected=0.1)
    measured = calibration.measure(calibration_values(name, make_batch(learner, rollout, mask)))
    calibration.apply(measured)
    assert calibration.done
    assert correction.params == {
        "lower": measured["correction/calibrated_lower"],
        "upper": measured["correction/calibrated_upper"],
    }
    out = correction(learner, rollout, mask)
    rows = [i for i in range(len(delta)) if np_mask[i].any()]
    if name == "token_mis":  # tokens
        rejected = (mask & ~out.mask).sum().item() / mask.sum().item()
        n = mask.sum().item()
    else:  # sequences
        rejected = out.metrics["correction/frac_seq_rejected"]
        n = len(rows)
    assert rejected == pytest.approx(measured["correction/calibration_rejected"], abs=1e-9)
    assert abs(rejected - 0.1) <= 2 / n + 1e-9


def test_a_bound_the_user_set_wins():
    learner, rollout, mask, _, _ = logprob_batch(seed=4)
    correction = build_correction({"name": "geo_rs", "lower": 0.5, "upper": None})
    calibration = BoundCalibration(correction, target_rejected=0.2)
    values = calibration_values("geo_rs", make_batch(learner, rollout, mask))
    calibration.apply(calibration.measure(values))
    assert correction.params["lower"] == 0.5
    expected_upper = np.exp(max(np.quantile(values.numpy(), 0.9), 0.0))
    assert correction.params["upper"] == pytest.approx(expected_upper)


def test_null_bounds_without_a_target_are_the_methods_defaults():
    correction = build_correction(
        {"name": "geo_rs", "lower": None, "upper": None, "target_rejected": None}
    )
    assert correction.params == {}
    learner, rollout, mask, _, _ = logprob_batch(seed=5)
    expected = get_correction("geo_rs", lower=0.999, upper=1.001)(learner, rollout, mask)
    torch.testing.assert_close(correction(learner, rollout, mask).mask, expected.mask)


def test_starved_rule():
    assert starved_scale(kept=64, tokens=64, min_kept=0.5, starved="scale") == 1.0
    assert starved_scale(kept=32, tokens=64, min_kept=0.5, starved="scale") == 1.0  # at it
    assert starved_scale(kept=8, tokens=64, min_kept=0.5, starved="scale") == 0.25
    assert starved_scale(kept=8, tokens=64, min_kept=0.5, starved="skip") == 0.0
    assert starved_scale(kept=0, tokens=64, min_kept=0.5, starved="scale") == 0.0
    assert starved_scale(kept=1, tokens=64, min_kept=0.0, starved="skip") == 1.0  # off
    assert starved_scale(kept=0, tokens=0, min_kept=0.5, starved="skip") == 1.0  # no tokens


def test_a_starved_update_moves_the_weights_by_its_share_of_the_rate():
    """Adam's first step is lr·sign(g) whatever |g|: scaling the gradient would change
    nothing, the rate does. The update at lr_scale 0.25 is a quarter of the full one."""
    moves = []
    for lr_scale in (1.0, 0.25):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        model(torch.randn(5, 4)).square().sum().backward()
        step = SimpleNamespace(model=model, optimizer=optimizer)
        TrainStep._optimizer_step(step, lr_scale)
        assert optimizer.param_groups[0]["lr"] == 1e-2  # the rate is restored after
        moves.append(
            torch.cat(
                [
                    (p.detach() - b).flatten()
                    for p, b in zip(model.parameters(), before, strict=True)
                ]
            )
        )
    torch.testing.assert_close(moves[1], 0.25 * moves[0])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target_rejected": 1.5}, r"correction\.target_rejected must be in \(0, 1\)"),
        ({"target_rejected": 0.0}, r"correction\.target_rejected must be in \(0, 1\)"),
        ({"target_rejected": "five"}, r"correction\.target_rejected must be a number"),
        ({"min_kept": -0.1}, r"correction\.min_kept must be in \[0, 1\]"),
        ({"min_kept": 2}, r"correction\.min_kept must be in \[0, 1\]"),
        ({"min_kept": True}, r"correction\.min_kept must be a number"),
        ({"starved": "drop"}, r"correction\.starved must be scale or skip"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        base = CorrectionConfig()
        values = [settings.get(key, getattr(base, key)) for key in REJECTION_KEYS]
        check_rejection_settings("geo_rs", *values)
    with pytest.raises(ValueError, match=message):
        build_correction({"name": "geo_rs", **settings})


def test_a_target_for_a_method_without_bounds_is_refused():
    with pytest.raises(ValueError, match=r"correction\.target_rejected calibrates .*token_tis"):
        build_correction({"name": "token_tis", "target_rejected": 0.05})


def test_hydra_refuses_bad_settings_at_compose_naming_the_key():
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException

    with initialize_config_module(version_base="1.3", config_module="asyncfp8.conf"):
        cfg = compose(overrides=["+correction=geo_rs"])
        assert cfg.correction.target_rejected == 0.05 and cfg.correction.lower is None
        for override, key in [
            ("correction.starved=drop", "starved"),
            ("correction.target_rejected=many", "target_rejected"),
        ]:
            with pytest.raises(Exception, match=key) as error:
                compose(overrides=["+correction=geo_rs", override])
            assert isinstance(error.value, ConfigCompositionException | ValueError)
        cfg = compose(overrides=["+correction=geo_rs", "correction.min_kept=3"])
        with pytest.raises(ValueError, match=r"correction\.min_kept must be in \[0, 1\]"):
            build_correction(cfg.correction)


def test_a_rolled_back_step_still_reports_the_bounds_it_calibrated():
    # The step calibrates before the guard judges its batch: when the guard rolls the step
    # back, the bounds stay set, so its metrics must still say what they are.
    from types import SimpleNamespace

    from asyncfp8.train.step_metrics import StepMetrics
    from asyncfp8.train.sums import StepSums

    group = SimpleNamespace(trajectories=[SimpleNamespace(reward=r) for r in (0.0, 1.0)])
    calibrated = {"correction/calibrated_lower": 0.9, "correction/calibrated_upper": 1.1}
    sums = StepSums(seen=None, rolled_back=True, rejection=calibrated)
    metrics = StepMetrics(None, pad_token_id=0).of_step([group], sums, 3, 1e-5, kl_ref=False)
    assert metrics["optim/updates"] == 0 and calibrated.items() <= metrics.items()


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    from tests.recorded import record_groups

    return record_groups(tiny_model_dir, steps=2, groups=4, group_size=4)


def learner_with(tiny_model_dir, run_dir, *overrides):
    from asyncfp8.learner import Learner
    from tests.recorded import learner_config

    learner = Learner(learner_config(tiny_model_dir, run_dir, *overrides))
    learner.version = 0
    return learner


@pytest.mark.slow
def test_the_learner_calibrates_once_on_its_first_step_and_scales_a_starved_update(
    tmp_path, tiny_model_dir, recorded
):
    """geo_rs's conf calibrates (target 0.05) on the first step's 16 fresh sequences; the
    bounds reject on that step what calibration measured, and stay for the next; with
    min_kept 1 the update that lost sequences runs at lr × kept share."""
    from tests.recorded import train

    learner = learner_with(
        tiny_model_dir, tmp_path / "run", "correction=geo_rs", "correction.min_kept=1.0"
    )
    try:
        first = train(learner, recorded[0])
        assert first["correction/calibration_values"] == 16
        assert first["correction/calibration_fresh"] == 1.0
        lower, upper = first["correction/calibrated_lower"], first["correction/calibrated_upper"]
        assert lower <= 1.0 <= upper and upper - lower < 0.5
        assert learner.correction.params == {"lower": lower, "upper": upper}
        assert first["correction/frac_seq_rejected"] == pytest.approx(
            first["correction/calibration_rejected"]
        )
        assert 0 < first["correction/kept_frac"] < 1
        assert first["correction/update_scale"] == pytest.approx(first["correction/kept_frac"])
        assert first["correction/starved"] == 1 and first["correction/starved_steps"] == 1
        second = train(learner, recorded[1])
        assert "correction/calibrated_lower" not in second  # once
        assert learner.correction.params == {"lower": lower, "upper": upper}
    finally:
        learner.close()


@pytest.mark.slow
def test_a_resumed_learner_keeps_the_bounds_its_first_step_measured(
    tmp_path, tiny_model_dir, recorded
):
    """Checkpointed with the run: the resumed learner's geo_rs bounds are the first step's,
    and it does not measure them again on its own first step."""
    from asyncfp8.learner import Learner
    from tests.recorded import learner_config, train

    learner = learner_with(tiny_model_dir, tmp_path / "run", "correction=geo_rs")
    try:
        first = train(learner, recorded[0])
        bounds = {key: first[f"correction/calibrated_{key}"] for key in ("lower", "upper")}
        learner.checkpoint()
    finally:
        learner.close()
    resumed = Learner(
        learner_config(tiny_model_dir, tmp_path / "run", "correction=geo_rs", "run.resume=true")
    )
    try:
        assert resumed.correction.params == bounds
        assert resumed.train_step.calibration.done
        assert "correction/calibrated_lower" not in train(resumed, recorded[1])
        assert resumed.correction.params == bounds
    finally:
        resumed.close()


@pytest.mark.slow
def test_a_starved_update_is_skipped_and_counted(tmp_path, tiny_model_dir, recorded):
    from asyncfp8.run import distributed
    from tests.recorded import train

    learner = learner_with(
        tiny_model_dir,
        tmp_path / "run",
        "correction=geo_rs",
        "correction.target_rejected=null",
        "correction.lower=1.0",
        "correction.upper=1.0",  # every sequence with any mismatch rejected
        "correction.starved=skip",
    )
    try:
        before = distributed.full_state_dict(learner.model)
        metrics = train(learner, recorded[0])
        assert metrics["correction/kept_frac"] < 0.5
        assert metrics["optim/updates"] == 0 and metrics["correction/update_scale"] == 0.0
        assert metrics["correction/starved_steps"] == 1
        after = distributed.full_state_dict(learner.model)
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    finally:
        learner.close()
