"""Run summaries, the smoothing behind the plots, and the comparison of settings: runs
grouped by setting, confidence intervals over seeds, and the refusal of runs that cannot
be compared."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from asyncfp8.report.compare import main
from asyncfp8.report.metrics import MetricsLog
from asyncfp8.report.plots import heldout_curve, plot_runs, smooth, trailing_mean
from asyncfp8.report.stats import binomial_se, mean_ci, t_quantile, t_two_sided_probability
from asyncfp8.report.summary import evaluations, per_step, setting, summarize
from tests.config import compose


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

# t_{0.975, df}, computed independently of asyncfp8.report.stats: mpmath (30 digits) integrating the
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


# --- comparing settings: fake finished runs ----------------------------------------------------


def fake_run(path, *overrides, greedy=(0.2, 0.5), sampled=(0.1, 0.4), kl=1e-3, prompts=256):
    """A finished run as the learner leaves it: its resolved config.yaml, and metrics.jsonl
    written by MetricsLog, with a held-out evaluation before training (step 0) and in the
    last step's record. 12 steps, all with current-version tokens (precision-only KL 1e-4)."""
    path.mkdir(parents=True)
    OmegaConf.save(compose(*overrides, f"run.dir={path}"), path / "config.yaml", resolve=True)
    log = MetricsLog(path, tensorboard=False)

    def evaluation(index):
        return {
            "eval/pass1_greedy": greedy[index],
            "eval/pass1_sampled": sampled[index],
            "eval/prompts": prompts,
        }

    log.write(0, {"version": 0} | evaluation(0))
    for step in range(1, 13):
        record = {
            "reward/mean": 0.5,
            "mismatch/kl_k3": kl,
            "fresh/kl_k3": 1e-4,
            "fresh/tokens": 50,
            "time/elapsed_s": step,
            "total/samples": 64 * step,
            "sync/version": step,
        }
        log.write(step, record | (evaluation(1) if step == 12 else {}))
    log.close()
    return str(path)


def parity_runs(tmp_path):
    """bf16 with 5 seeds (final greedy 0.1..0.5, KL 1..5e-3), fp8 without correction with 2
    (0.2, 0.4), and fp8 with a quantized learner forward with 1."""
    runs = []
    for seed, final in enumerate([0.1, 0.2, 0.3, 0.4, 0.5]):
        runs.append(
            fake_run(
                tmp_path / f"bf16_s{seed}",
                "precision=bf16",
                "correction=token_tis",
                f"run.seed={seed}",
                greedy=(0.05 * seed, final),
                sampled=(0.1, final - 0.05),
                kl=(seed + 1) * 1e-3,
            )
        )
    for seed, final in enumerate([0.2, 0.4]):
        runs.append(
            fake_run(
                tmp_path / f"fp8_none_s{seed}",
                "precision=fp8",
                "correction=none",
                f"run.seed={seed}",
                greedy=(0.1, final),
                prompts=64,
            )
        )
    runs.append(
        fake_run(
            tmp_path / "fp8_quantized_s0",
            "precision=fp8",
            "precision.learner_forward=quantized",
            "correction=token_tis",
            greedy=(0.1, 0.36),
        )
    )
    runs.append(
        fake_run(
            tmp_path / "fp8_from_bf16_s0",
            "precision=fp8",
            "precision.quantize_from=compute",
            "run.compute_dtype=bfloat16",
            "correction=token_tis",
            greedy=(0.1, 0.4),
        )
    )
    runs.append(
        fake_run(
            tmp_path / "fp8_fp32_engine_s0",
            "precision=fp8",
            "precision.engine_dtype=float32",
            "correction=token_tis",
            greedy=(0.1, 0.42),
        )
    )
    return runs


def test_runs_are_grouped_by_setting_and_seeds_give_the_confidence_interval(tmp_path, capsys):
    runs = parity_runs(tmp_path)
    out, table = tmp_path / "out" / "compare.png", tmp_path / "out" / "compare.json"
    main([*runs, "--out", str(out), "--json", str(table)])
    printed = capsys.readouterr().out
    groups = {g["label"]: g for g in json.loads(table.read_text())["groups"]}
    assert list(groups) == [
        "bf16 · token_tis · async",
        "fp8 · none · async",
        "fp8 (quantized forward) · token_tis · async",
        "fp8 (quantized from compute weights, learner in bfloat16) · token_tis · async",
        "fp8 (engine in float32) · token_tis · async",
    ]
    bf16 = groups["bf16 · token_tis · async"]
    assert (bf16["precision"], bf16["correction"], bf16["learner_forward"], bf16["mode"]) == (
        "bf16",
        "token_tis",
        "master",
        "async",
    )
    assert (bf16["n"], bf16["seeds"], bf16["runs"]) == (5, [0, 1, 2, 3, 4], runs[:5])
    assert bf16["final_greedy_mean"] == pytest.approx(0.3)
    assert bf16["final_greedy_ci95"] == pytest.approx(0.196324316, rel=1e-8)
    assert bf16["final_sampled_mean"] == pytest.approx(0.25)
    assert bf16["final_sampled_ci95"] == pytest.approx(0.196324316, rel=1e-8)  # same spread
    assert bf16["start_greedy_mean"] == pytest.approx(0.1)  # 0, 0.05, ..., 0.2
    assert bf16["start_greedy_ci95"] == pytest.approx(0.5 * 0.196324316, rel=1e-8)
    assert (bf16["start_sampled_mean"], bf16["start_sampled_ci95"]) == pytest.approx((0.1, 0.0))
    assert bf16["kl_k3_mean"] == pytest.approx(3e-3)
    assert bf16["kl_k3_ci95"] == pytest.approx(0.0196324316 * 0.1, rel=1e-8)
    assert (bf16["fresh_kl_k3_mean"], bf16["fresh_kl_k3_ci95"]) == pytest.approx((1e-4, 0.0))
    assert bf16["fresh_kl_runs"] == 5
    assert bf16["eval_prompts"] == [256] * 5 and bf16["final_eval_steps"] == [12] * 5
    assert bf16["final_greedy_binomial_se"] == pytest.approx(math.sqrt(0.3 * 0.7 / 256))
    assert bf16["warnings"] == []

    fp8 = groups["fp8 · none · async"]
    assert (fp8["n"], fp8["seeds"]) == (2, [0, 1])
    assert (fp8["final_greedy_mean"], fp8["final_greedy_ci95"]) == pytest.approx((0.3, 1.2706205))
    assert fp8["final_greedy_binomial_se"] == pytest.approx(math.sqrt(0.3 * 0.7 / 64))

    single = groups["fp8 (quantized forward) · token_tis · async"]
    assert (single["n"], single["learner_forward"]) == (1, "quantized")
    assert (single["final_greedy_mean"], single["final_greedy_ci95"]) == (0.36, None)
    rounded = groups[
        "fp8 (quantized from compute weights, learner in bfloat16) · token_tis · async"
    ]
    assert (rounded["quantize_from"], rounded["compute_dtype"]) == ("compute", "bfloat16")
    assert rounded["final_greedy_mean"] == 0.4
    fp32_engine = groups["fp8 (engine in float32) · token_tis · async"]
    assert (fp32_engine["engine_dtype"], fp32_engine["final_greedy_mean"]) == ("float32", 0.42)
    assert bf16["engine_dtype"] == "policy"

    # the printed table says the same
    assert "bf16 · token_tis · async: 5 runs, seeds 0 1 2 3 4" in printed
    assert "  greedy            0.300 ± 0.196       0.100 ± 0.098\n" in printed
    assert "256 prompts a run; one run's final greedy pass@1 has a binomial SE of 0.029" in printed
    assert "mismatch KL k3 (a run's mean over steps): 3.00e-03 ± 1.96e-03" in printed
    assert "  greedy            0.300 ± 1.271       0.100 ± 0.000\n" in printed  # 2 seeds
    assert "fp8 (quantized forward) · token_tis · async: 1 run, seed 0 (n=1, no CI)" in printed
    assert "  greedy            0.360               0.100\n" in printed
    # both PNGs: the per-step panels and the held-out curves with their bands
    assert out.stat().st_size > 10_000
    assert (tmp_path / "out" / "compare_heldout.png").stat().st_size > 10_000
    assert "held-out curves: " + str(tmp_path / "out" / "compare_heldout.png") in printed
    # the per-run summaries are still there, with the evaluation's size and noise
    per_run = json.loads(table.read_text())["runs"]
    assert [r["run"] for r in per_run] == runs
    assert per_run[0]["eval_prompts"] == 256
    assert per_run[0]["eval_pass1_greedy_end_se"] == pytest.approx(math.sqrt(0.1 * 0.9 / 256))


def test_the_held_out_curve_is_the_mean_over_seeds_with_a_t_band(tmp_path):
    runs = parity_runs(tmp_path)
    steps, means, halves = heldout_curve([evaluations(r) for r in runs[:5]], "eval/pass1_greedy")
    assert steps == [0, 12]
    np.testing.assert_allclose(means, [0.1, 0.3])
    np.testing.assert_allclose(halves, [0.5 * 0.196324316, 0.196324316], rtol=1e-8)
    steps, means, halves = heldout_curve([evaluations(runs[-1])], "eval/pass1_greedy")
    assert np.isnan(halves).all()  # one run: no band


def test_a_plugin_precision_is_its_class_and_labels_still_group_runs(tmp_path, capsys):
    cfg = compose("precision._target_=examples.harsh.Int4Policy", "correction=none")
    assert setting(cfg) == {
        "precision": "examples.harsh.Int4Policy",
        "correction": "none",
        "learner_forward": "master",
        "quantize_from": "master",
        "compute_dtype": "auto",
        "engine_dtype": "policy",
        "mode": "async",
        "proximal": "auto",
        "guard": "on",
    }
    a = fake_run(tmp_path / "a", "precision=bf16")
    b = fake_run(tmp_path / "b", "precision=fp8", greedy=(0.2, 0.3))
    table = tmp_path / "t.json"
    main([a, b, "--labels", "mine", "mine", "--out", str(tmp_path / "p.png"), "--json", str(table)])
    (group,) = json.loads(table.read_text())["groups"]
    assert (group["label"], group["n"], group["precision"]) == ("mine", 2, ["bf16", "fp8"])
    assert group["final_greedy_mean"] == pytest.approx(0.4)
    assert any("different settings (precision)" in w for w in group["warnings"])
    assert "warning: the label groups runs of different settings" in capsys.readouterr().out


def test_seeds_that_differ_in_more_than_the_seed_are_warned_about(tmp_path, capsys):
    a = fake_run(tmp_path / "a", "run.seed=0")
    b = fake_run(tmp_path / "b", "run.seed=1", "correction.threshold=5.0", "run.workers=4")
    c = fake_run(tmp_path / "c", "run.seed=1")
    main([a, b, c, "--out", str(tmp_path / "p.png")])
    printed = capsys.readouterr().out
    assert "differ in more than the seed: correction.threshold: 2.0 in" in printed
    assert "run.workers" not in printed  # how many processes ran it is not the experiment
    assert "seed 1 appears more than once" in printed


def refused(capsys, *argv):
    """What the report says on stderr when it refuses `argv` at start (nothing drawn)."""
    out = Path(argv[-1]).parent / "never.png"
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--out", str(out)])
    assert stopped.value.code == 2
    assert not out.exists()
    return capsys.readouterr().err


def test_runs_of_different_tasks_or_models_are_refused_naming_the_setting(tmp_path, capsys):
    a = fake_run(tmp_path / "a")
    b = fake_run(tmp_path / "b", "task.digits=4")
    c = fake_run(tmp_path / "c", "model.seed=3")
    message = refused(capsys, a, b, c)
    assert "cannot compare these runs: their task or model differ" in message
    assert f"task.digits: 3 in {a}, {c}; 4 in {b}" in message
    assert f"model.seed: 0 in {a}, {b}; 3 in {c}" in message
    d = fake_run(tmp_path / "d", "task=gsm8k_jsonl")
    assert f'task.name: "addition" in {a}; "gsm8k_jsonl" in {d}' in refused(capsys, a, d)


def test_a_directory_that_is_not_a_run_is_named(tmp_path, capsys):
    run = fake_run(tmp_path / "runs" / "a")
    fake_run(tmp_path / "runs" / "b")
    message = refused(capsys, str(tmp_path / "runs"), str(tmp_path / "nowhere"), run)
    assert f"{tmp_path / 'runs'} is not a run: it has no config.yaml" in message
    assert f"it holds 2 runs (a, b): pass those, e.g. {tmp_path / 'runs'}/*" in message
    assert f"{tmp_path / 'nowhere'}: no such directory" in message
    (tmp_path / "runs" / "a" / "metrics.jsonl").unlink()
    assert "never wrote metrics.jsonl" in refused(capsys, run)
    (tmp_path / "runs" / "a" / "metrics.jsonl").write_text("")
    assert "no metrics" in refused(capsys, run)
    assert "given more than once" in refused(capsys, run, run)


def test_paired_with_a_baseline_gives_each_group_its_per_seed_difference(tmp_path, capsys):
    runs = parity_runs(tmp_path)
    table = tmp_path / "compare.json"
    baseline = "bf16 · token_tis · async"
    main([*runs, "--out", str(tmp_path / "c.png"), "--json", str(table), "--paired-with", baseline])
    groups = {g["label"]: g for g in json.loads(table.read_text())["groups"]}
    assert "paired_with" not in groups[baseline]
    fp8 = groups["fp8 · none · async"]  # seeds 0, 1: 0.2 - 0.1 and 0.4 - 0.2
    assert (fp8["paired_with"], fp8["paired_seeds"]) == (baseline, [0, 1])
    assert fp8["paired_greedy_diff_mean"] == pytest.approx(0.15)
    assert fp8["paired_greedy_diff_ci95"] == pytest.approx(12.706205 * 0.05, rel=1e-6)
    single = groups["fp8 (quantized forward) · token_tis · async"]
    assert single["paired_greedy_diff_mean"] == pytest.approx(0.26)
    assert single["paired_greedy_diff_ci95"] is None
    printed = capsys.readouterr().out
    assert f"  against {baseline}: greedy +0.150 ± 0.635, paired over 2 seeds (0 1)" in printed
    assert "greedy +0.260 (one seed, no CI), paired over 1 seed (0)" in printed


def test_paired_with_a_label_that_is_no_group_is_refused_naming_the_groups(tmp_path, capsys):
    runs = parity_runs(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main([*runs, "--out", str(tmp_path / "c.png"), "--paired-with", "bf16"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "--paired-with 'bf16' is not a group here" in err and "'bf16 · token_tis · async'" in err


def test_an_engine_dtype_that_is_the_policys_own_groups_with_the_default():
    assert setting(compose("precision=fp8"))["engine_dtype"] == "policy"
    assert setting(compose("precision=fp8", "precision.engine_dtype=bfloat16"))["engine_dtype"] == (
        "policy"
    )
    assert setting(compose("precision=fp16", "precision.engine_dtype=float16"))["engine_dtype"] == (
        "policy"
    )
    assert setting(compose("precision=fp8", "precision.engine_dtype=float32"))["engine_dtype"] == (
        "float32"
    )
