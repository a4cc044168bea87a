"""Run summaries, the smoothing behind the plots, and the confidence intervals over seeds."""

import json
import math

import numpy as np
import pytest

from asyncfp8.report import per_step, plot_runs, smooth, summarize, trailing_mean
from asyncfp8.stats import binomial_se, mean_ci, t_quantile, t_two_sided_probability


def test_smooth_is_a_trailing_mean_that_skips_nan():
    rng = np.random.default_rng(0)
    values = rng.normal(size=50)
    values[[3, 17, 18]] = np.nan
    window = 7
    expected = [np.nanmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(smooth(values, window), expected, rtol=1e-12)


def write_run(path, rewards, repeat_step=None):
    path.mkdir()
    lines = []
    for step, reward in enumerate(rewards, 1):
        lines.append(
            {
                "step": step,
                "reward/mean": reward,
                "mismatch/kl_k3": 1e-3,
                "fresh/kl_k3": None,
                "time/elapsed_s": step * 0.5,
                "total/samples": step * 64,
                "sync/version": step,
            }
        )
    if repeat_step:  # a resumed learner writes a step again; the later record wins
        lines.append(lines[repeat_step - 1] | {"reward/mean": 1.0})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_summary_uses_the_first_and_last_fifth_and_the_last_record_of_a_step(tmp_path):
    write_run(tmp_path / "a", [0.0] * 2 + [0.5] * 6 + [0.9] * 2, repeat_step=10)
    assert len(per_step(tmp_path / "a")) == 10
    summary = summarize(tmp_path / "a")
    assert summary["reward_start"] == 0.0
    assert summary["reward_end"] == pytest.approx((0.9 + 1.0) / 2)
    assert summary["samples_per_s"] == pytest.approx(640 / 5.0)
    assert summary["fresh_kl_k3_mean"] is None  # no step had current-version tokens
    assert summary["fresh_kl_steps"] == 0
    with pytest.raises(ValueError, match="no metrics"):
        summarize(tmp_path)


def test_the_precision_only_kl_is_reported_with_its_support_or_left_out(tmp_path):
    def run(name, fresh_steps):
        write_run(tmp_path / name, [0.5] * 40)
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        for r in records[:fresh_steps]:
            r |= {"fresh/kl_k3": 2e-3, "fresh/tokens": 50}
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
        return summarize(tmp_path / name)

    few = run("few", 2)  # an asynchronous run: two steps had current-version tokens
    assert few["fresh_kl_k3_mean"] is None and few["fresh_kl_steps"] == 2
    assert any("rests on 2 steps" in w for w in few["warnings"])
    enough = run("enough", 12)
    assert enough["fresh_kl_k3_mean"] == pytest.approx(2e-3)
    assert (enough["fresh_kl_steps"], enough["fresh_kl_tokens"]) == (12, 600)


def test_a_run_without_reward_spread_is_warned_about(tmp_path):
    write_run(tmp_path / "flat", [0.0] * 30)
    records = [json.loads(line) for line in (tmp_path / "flat" / "metrics.jsonl").open()]
    lines = [json.dumps(r | {"groups/frac_zero_advantage": 0.9}) for r in records]
    (tmp_path / "flat" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize(tmp_path / "flat")
    assert summary["frac_zero_advantage_mean"] == pytest.approx(0.9)
    assert any("no reward spread" in w for w in summary["warnings"])


def test_plot_of_two_runs(tmp_path):
    write_run(tmp_path / "a", np.linspace(0.2, 0.5, 30))
    write_run(tmp_path / "b", np.linspace(0.3, 0.4, 30))
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "p.png", labels=["x", "x"])
    assert out.stat().st_size > 10_000


def test_summary_carries_held_out_pass_at_1_before_and_after_training(tmp_path):
    write_run(tmp_path / "a", [0.0] * 2 + [0.5] * 6 + [0.9] * 2)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    records[4] |= {"eval/pass1_greedy": 0.3, "eval/pass1_sampled": 0.2}
    records[9] |= {"eval/pass1_greedy": 0.5, "eval/pass1_sampled": 0.4}
    baseline = {"step": 0, "version": 0, "eval/pass1_greedy": 0.25, "eval/pass1_sampled": 0.1}
    (tmp_path / "a" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [baseline, *records])
    )
    assert [r["step"] for r in per_step(tmp_path / "a")] == list(range(1, 11))  # training steps
    summary = summarize(tmp_path / "a")
    assert summary["eval_steps"] == [0, 5, 10]
    assert (summary["eval_pass1_greedy_start"], summary["eval_pass1_greedy_end"]) == (0.25, 0.5)
    assert (summary["eval_pass1_sampled_start"], summary["eval_pass1_sampled_end"]) == (0.1, 0.4)
    assert summary["reward_start"] == 0.0 and summary["steps"] == 10  # step 0 trains nothing
    write_run(tmp_path / "b", [0.1] * 5)
    assert np.isnan(summarize(tmp_path / "b")["eval_pass1_greedy_end"])  # evaluation off


def test_trailing_mean_starts_once_its_window_is_full():
    values = np.arange(10, dtype=float)
    got = trailing_mean(values, 4)
    assert np.isnan(got[:3]).all()  # no "mean" of one to three points drawn
    np.testing.assert_allclose(got[3:], [np.mean(values[i - 3 : i + 1]) for i in range(3, 10)])


# --- confidence intervals ----------------------------------------------------------------------

# t_{0.975, df}, computed independently of asyncfp8.stats: mpmath (30 digits) integrating the
# t density and solving CDF(t) = 0.975 with findroot. They agree with printed tables
# (12.706, 4.303, 2.776, 2.262, 2.042, 1.962).
T_975 = {
    1: 12.7062047361747,
    2: 4.30265272974946,
    3: 3.18244630528371,
    4: 2.77644510519779,
    9: 2.26215716279821,
    30: 2.04227245630124,
    1000: 1.96233908082641,  # the last df of the closed-form series
    1001: 1.96233670528088,  # the first of the Cornish-Fisher expansion
    5000: 1.96043855170651,
}


@pytest.mark.parametrize("df", sorted(T_975))
def test_the_t_quantile_matches_independently_computed_values(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-12)
    assert t_two_sided_probability(T_975[df], df) == pytest.approx(0.95, abs=1e-12)


def test_the_t_quantile_matches_scipy_where_it_is_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 17, 200, 999, 1001, 20000):
        for p in (0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-10)


def test_mean_ci_on_known_inputs():
    # sd of 0.1..0.5 is 0.158113883; half-width t_{0.975,4} * sd / sqrt(5)
    mean, half = mean_ci([0.1, 0.2, 0.3, 0.4, 0.5])
    assert mean == pytest.approx(0.3)
    assert half == pytest.approx(2.776445105 * 0.158113883 / math.sqrt(5), rel=1e-8)
    assert half == pytest.approx(0.196324316, rel=1e-8)
    # two values: sd 0.141421356, t_{0.975,1} = 12.70620474; half-width = 12.70620474 * 0.1
    assert mean_ci([0.2, 0.4]) == pytest.approx((0.3, 1.270620474))
    assert mean_ci([0.25, 0.25, 0.25]) == (0.25, 0.0)
    assert mean_ci([0.7]) == (0.7, None)  # one run: no spread to measure, no interval
    assert mean_ci([0.1, 0.3], level=0.9)[1] == pytest.approx(6.313751515 * 0.1, rel=1e-8)
    with pytest.raises(ValueError, match="no values"):
        mean_ci([])
    assert binomial_se(0.5, 256) == 0.03125
    with pytest.raises(ValueError, match="whole number"):
        t_quantile(0.975, 0)
