"""`run.phase_times`: where the learner's step goes, phase by phase, in its metrics."""

import time

import pytest
import torch

from asyncfp8.report.summary import per_step
from asyncfp8.train.phases import PhaseClock

STEP_PHASES = ("prepare", "forward", "backward", "guard", "optimizer")


def test_the_clock_adds_each_phase_and_starts_again_after_a_take():
    clock = PhaseClock("auto", torch.device("cpu"))
    for _ in range(2):
        with clock("forward"):
            time.sleep(0.02)
    with clock("backward"), clock("inner"):  # nested: counted in both
        time.sleep(0.01)
    taken = clock.take()
    assert set(taken) == {"time/phase/forward_s", "time/phase/backward_s", "time/phase/inner_s"}
    assert taken["time/phase/forward_s"] >= 0.04
    assert taken["time/phase/backward_s"] >= taken["time/phase/inner_s"] >= 0.01
    assert clock.take() == {}


@pytest.mark.parametrize(
    "setting, device, on", [("auto", "cpu", True), ("auto", "cuda", False), ("false", "cpu", False)]
)
def test_auto_times_the_cpu_only_and_false_nothing(setting, device, on):
    clock = PhaseClock(setting, torch.device(device))
    with clock("forward"):
        pass
    assert bool(clock.take()) == on and clock.on == on


def test_a_setting_out_of_range_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"run\.phase_times must be auto, true or false"):
        PhaseClock("sometimes", torch.device("cpu"))


@pytest.mark.slow
def test_every_step_of_a_run_says_where_its_training_went(separate_turns):
    """The train step's phases lie inside its `time/train_s`, and every phase inside the
    step's wall time (measured on this CPU: auto)."""
    run_dir, _ = separate_turns
    steps = per_step(run_dir)
    assert steps
    for record in steps:
        phases = {k: v for k, v in record.items() if k.startswith("time/phase/")}
        for name in ("prepare", "forward", "backward", "optimizer", "publish"):
            assert phases.get(f"time/phase/{name}_s", -1) >= 0, (name, phases)
        inside = sum(phases.get(f"time/phase/{name}_s", 0.0) for name in STEP_PHASES)
        assert inside <= record["time/train_s"] + 1e-3, (inside, record["time/train_s"])
        assert phases["time/phase/publish_s"] <= record["time/step_total_s"]


def test_the_bench_table_accounts_for_the_whole_step():
    """bench/learner_phases.py: the rows (π_prox counted once, inside prepare) add up to
    the step's wall time, the untimed rest included."""
    from bench.learner_phases import rows_of

    means = dict(prepare=0.1, proximal=0.05, forward=0.2, backward=0.3, guard=0.01)
    means |= dict(optimizer=0.05, publish=0.02, eval=0.1, checkpoint=0.0)
    means |= {"time/wait_s": 0.04, "time/train_s": 0.7, "time/step_total_s": 1.0}
    rows = {row["phase"]: row for row in rows_of(means)}
    assert rows["train step, untimed"]["seconds"] == pytest.approx(0.04)
    assert rows["loop, untimed"]["seconds"] == pytest.approx(0.14)
    counted = sum(r["seconds"] for name, r in rows.items() if name != "proximal")
    assert counted == pytest.approx(1.0)
    assert rows["backward"]["share_of_step"] == pytest.approx(0.3)
