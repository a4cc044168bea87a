"""bench/scaling.py: the planner's asynchronous step from a synchronous run's phases, and
a run under a CPU affinity uses only those cores."""

import os

import pytest

from bench.peers import compose, run_asyncfp8
from bench.scaling import planner_prediction


def sync_row(generate, train, publish):
    return {"phase_s_median": {"generate": generate, "train": train, "publish_on_thread": publish}}


@pytest.mark.parametrize(
    ("generate", "train", "publish", "step"),
    [
        (0.4, 0.3, 0.05, 0.4),  # generation is the longer side: the learner waits for it
        (0.2, 0.3, 0.05, 0.35),  # training and the publish on its thread are
    ],
)
def test_the_planner_predicts_the_longer_side_of_the_overlap(generate, train, publish, step):
    # Cores to spare (each side on cores of its own): the planner's model holds as it is.
    predicted = planner_prediction(sync_row(generate, train, publish), cores=64, workers=1)
    assert predicted["predicted_async_step_s"] == pytest.approx(step)
    assert predicted["predicted_speedup"] == pytest.approx((generate + train + publish) / step)
    assert predicted["shared_cores_async_step_s"] == pytest.approx(step)


def test_on_shared_cores_the_overlap_cannot_beat_the_busy_core_seconds():
    # One core: generation (0.4 s) and training (0.3 s) share it, so overlapping them
    # saves nothing; two workers and a learner on two cores (one thread each): the
    # workers kept both cores busy for 0.2 s, the learner one for 0.35 s.
    one = planner_prediction(sync_row(0.4, 0.3, 0.0), cores=1, workers=1)
    assert one["shared_cores_async_step_s"] == pytest.approx(0.7)
    assert one["shared_cores_speedup"] == pytest.approx(1.0)
    two = planner_prediction(sync_row(0.2, 0.3, 0.05), cores=2, workers=2)
    assert two["predicted_async_step_s"] == pytest.approx(0.35)
    assert two["shared_cores_async_step_s"] == pytest.approx((0.2 * 2 + 0.35) / 2)


@pytest.mark.slow
def test_a_run_limited_to_one_core_gives_each_process_one_thread(tmp_path, tiny_model_dir):
    job = [f"model.path={tiny_model_dir}", "run.steps=3", "eval.every=0", "run.workers=1"]
    job += ["run.placement=separate", "run.tensorboard=false", "run.groups_per_step=2"]
    cfg = compose(job)
    one = {min(os.sched_getaffinity(0))}
    row = run_asyncfp8(job, tmp_path / "run", 1, 2 * cfg.run.group_size, cores=one)
    assert row["trained_samples_per_s"] > 0
    log = (tmp_path / "run" / "worker-0.log").read_text()
    assert ", 1 torch threads;" in log, log[-2000:]
