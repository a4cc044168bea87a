"""Collapse, defined and counted (issue 45): the two rules of asyncfp8/report/collapse.py on
curves built here, the Wilson interval against published values and an independent
root-finding, and the report's count per group over synthetic run directories."""

import json
import math
from pathlib import Path
from statistics import NormalDist

import pytest
from omegaconf import OmegaConf

from asyncfp8.report.collapse import collapse_of, heldout_collapse, reward_collapse
from asyncfp8.report.compare import main
from asyncfp8.report.metrics import MetricsLog
from asyncfp8.report.stats import wilson_interval
from asyncfp8.run.files import GUARD_STOP_FILE
from tests.config import compose


def test_held_out_below_half_its_best_at_the_end_is_a_collapse():
    # int8 + token_tis seed 3 of the parity study: 0.895 -> 0.000 at step 100
    curve = [(0, 0.30), (50, 0.895), (100, 0.0), (150, 0.0)]
    found = heldout_collapse(curve)
    assert (found.collapsed, found.signal, found.step) == (True, "held-out", 100)
    assert "0.895 at step 50" in found.reason


def test_a_dip_that_recovers_is_not_a_collapse_but_is_said():
    # the bf16 parity run: 0.863 -> 0.309 at step 100, back to 0.781 by step 200
    found = heldout_collapse([(0, 0.2), (50, 0.863), (100, 0.309), (150, 0.6), (200, 0.781)])
    assert not found.collapsed and found.fell_and_recovered


def test_a_run_that_never_learned_or_barely_fell_did_not_collapse():
    assert not heldout_collapse([(0, 0.05), (50, 0.09), (100, 0.0)]).collapsed  # best < 0.1
    assert not heldout_collapse([(0, 0.5), (50, 0.8), (100, 0.41)]).collapsed  # 0.41 >= 0.4
    assert not heldout_collapse([]).collapsed


def test_the_stream_reward_dead_for_20_steps_after_learning_is_a_collapse():
    learned, dead = [0.5] * 25, [0.0] * 19 + [0.04]
    rewards = list(enumerate(learned + dead + [0.3] * 5, 1))
    found = reward_collapse(rewards)
    assert (found.collapsed, found.signal, found.step) == (True, "reward", 26)
    # 19 dead steps are not 20
    assert not reward_collapse(list(enumerate(learned + dead[:19] + [0.5] * 30, 1))).collapsed
    # a task too hard from the start: never learned, so never collapsed
    assert not reward_collapse(list(enumerate([0.01] * 100, 1))).collapsed


def test_both_rules_the_first_by_step_names_it():
    rewards = list(enumerate([0.6] * 30 + [0.0] * 40, 1))  # dead from step 31
    heldout = [(0, 0.2), (25, 0.9), (50, 0.0), (70, 0.0)]
    found = collapse_of(rewards, heldout)
    assert (found.collapsed, found.signal, found.step) == (True, "reward", 31)
    assert collapse_of(rewards[:30], heldout).signal == "held-out"
    assert not collapse_of(rewards[:30], heldout[:2]).collapsed


@pytest.mark.parametrize(
    "events, trials, low, high",
    # Newcombe (1998), Statistics in Medicine 17:857, Table II, method 3 (Wilson, no
    # continuity correction)
    [
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_matches_newcombes_table(events, trials, low, high):
    assert wilson_interval(events, trials) == pytest.approx((low, high), abs=5e-5)


def score_bound(events, trials, lower):
    """An independent Wilson bound: bisection on |k/n - p| = z sqrt(p(1-p)/n)."""
    z, rate = NormalDist().inv_cdf(0.975), events / trials
    a, b = (0.0, rate) if lower else (rate, 1.0)

    def outside(p):  # True where p lies beyond the bound, on the searched side
        return abs(rate - p) > z * math.sqrt(p * (1 - p) / trials)

    if not outside(a if lower else b):
        return a if lower else b
    for _ in range(200):
        middle = (a + b) / 2
        if outside(middle) == lower:
            a = middle
        else:
            b = middle
    return (a + b) / 2


@pytest.mark.parametrize("trials", [1, 3, 5, 10, 37])
def test_wilson_matches_root_finding_and_stays_in_0_1(trials):
    for events in range(trials + 1):
        low, high = wilson_interval(events, trials)
        assert 0.0 <= low <= events / trials <= high <= 1.0
        assert low == pytest.approx(score_bound(events, trials, True), abs=1e-9)
        assert high == pytest.approx(score_bound(events, trials, False), abs=1e-9)
    with pytest.raises(ValueError, match="events <= trials"):
        wilson_interval(trials + 1, trials)


def synthetic_run(path, seed, heldout, rewards):
    """A finished run: config.yaml, and metrics.jsonl with `rewards` per step and
    `heldout` {step: greedy pass@1} (step 0: before training)."""
    path.mkdir(parents=True)
    OmegaConf.save(compose(f"run.seed={seed}", f"run.dir={path}"), path / "config.yaml")
    log = MetricsLog(path, tensorboard=False)
    evaluation = {"eval/pass1_sampled": 0.1, "eval/prompts": 128}
    log.write(0, {"version": 0, "eval/pass1_greedy": heldout[0]} | evaluation)
    for step, reward in enumerate(rewards, 1):
        record = {"reward/mean": reward, "mismatch/kl_k3": 1e-3, "time/elapsed_s": step}
        record |= {"total/samples": 64 * step, "sync/version": step}
        if step in heldout:
            record |= {"eval/pass1_greedy": heldout[step]} | evaluation
        log.write(step, record)
    log.close()
    return str(path)


def test_the_report_counts_collapses_per_group_with_a_wilson_interval(tmp_path, capsys):
    learned = [0.5] * 40
    runs = [
        synthetic_run(tmp_path / "s0", 0, {0: 0.2, 20: 0.8, 40: 0.85}, learned),
        synthetic_run(tmp_path / "s1", 1, {0: 0.2, 20: 0.9, 40: 0.0}, learned[:21] + [0.0] * 19),
        synthetic_run(tmp_path / "s2", 2, {0: 0.2, 20: 0.3, 40: 0.8}, learned),
        synthetic_run(tmp_path / "s3", 3, {0: 0.2, 10: 0.8, 20: 0.2, 40: 0.7}, learned),
    ]
    table = tmp_path / "compare.json"
    main([*runs, "--out", str(tmp_path / "compare.png"), "--json", str(table)])
    printed = capsys.readouterr().out
    (group,) = json.loads(table.read_text())["groups"]
    assert group["collapses"] == 1
    assert group["collapse_rate_ci95"] == pytest.approx(wilson_interval(1, 4))
    # seed 1: held-out at step 40; its reward dead for 19 steps only (not yet the rule)
    assert group["collapsed_runs"] == [{"seed": 1, "step": 40, "signal": "held-out"}]
    assert group["fell_and_recovered"] == 1  # seed 3's dip to 0.2
    low, high = wilson_interval(1, 4)
    assert f"collapsed         1 of 4 (rate 95% CI {low:.2f}-{high:.2f}, Wilson)" in printed
    assert "seed 1 at step 40 (held-out)" in printed
    assert "1 more fell below half their best held-out and recovered" in printed
    summaries = {s["run"]: s for s in json.loads(table.read_text())["runs"]}
    assert summaries[runs[1]]["collapsed"] and not summaries[runs[0]]["collapsed"]
    # late slides beside the collapses: seed 1 (0.9 -> 0.0); seed 3's 0.8 -> 0.7 is not > 0.1
    assert group["late_slides"] == 1
    assert group["late_slide_runs"] == [{"seed": 1, "drop": pytest.approx(0.9)}]
    assert f"slid late         1 of 4 (rate 95% CI {low:.2f}-{high:.2f}, Wilson): seed 1" in printed
    assert summaries[runs[1]]["late_slide"] and not summaries[runs[3]]["late_slide"]


def test_the_report_counts_the_runs_the_guard_stopped(tmp_path, capsys):
    """A run the guard stopped (its learner wrote guard_stop.json) ended early: the group
    names it beside its collapses, whatever its held-out said before."""
    learned = [0.5] * 40
    runs = [
        synthetic_run(tmp_path / f"s{seed}", seed, {0: 0.2, 40: 0.8}, learned) for seed in (0, 1)
    ]
    stopped = synthetic_run(tmp_path / "s2", 2, {0: 0.2}, learned[:30])
    stop = {"step": 30, "signal": "far_tokens", "detail": "19 of 2182 tokens", "good_step": 27}
    (Path(stopped) / GUARD_STOP_FILE).write_text(json.dumps(stop))
    table = tmp_path / "compare.json"
    main([*runs, stopped, "--out", str(tmp_path / "compare.png"), "--json", str(table)])
    printed = capsys.readouterr().out
    (group,) = json.loads(table.read_text())["groups"]
    assert group["guard_stops"] == 1
    assert group["guard_stopped_runs"] == [{"seed": 2, "step": 30, "signal": "far_tokens"}]
    assert "guard stopped     1 of 3: seed 2 at step 30 (far_tokens)" in printed
    summaries = {s["run"]: s for s in json.loads(table.read_text())["runs"]}
    assert summaries[stopped]["guard_stopped"]["good_step"] == 27
    assert summaries[runs[0]]["guard_stopped"] is None


def test_an_end_more_than_a_tenth_below_the_last_50_steps_best_is_a_late_slide():
    from asyncfp8.report.collapse import late_slide

    # fp8 + fp8 KV seed 6 of the stability study: 0.977 at step 250, 0.781 at 300
    found = late_slide([(0, 0.309), (250, 0.977), (300, 0.781)])
    assert found.slid and found.drop == pytest.approx(0.196) and found.best_step == 250
    # the default job of 2026-12-07: 0.941 at 250, 0.988 at 300; and a small waver
    assert not late_slide([(0, 0.309), (250, 0.941), (300, 0.988)]).slid
    assert not late_slide([(0, 0.3), (250, 0.95), (300, 0.86)]).slid  # 0.09 is not > 0.1
    # a best outside the last 50 steps does not count: the rule is about the end
    assert not late_slide([(0, 0.3), (200, 0.99), (250, 0.85), (300, 0.86)]).slid
    assert not late_slide([]).slid and not late_slide([(0, 0.3)]).slid
    # the held-out guard undid the last evaluation (0.430, restored to 0.980): it slid
    undone = late_slide([(0, 0.309), (250, 0.980), (300, 0.430), (300, 0.980)])
    assert undone.slid and undone.drop == pytest.approx(0.55)
