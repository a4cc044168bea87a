"""`srun python -m asyncfp8.launch` (issue 30, part 5): each task finds its role from
Slurm's variables (asyncfp8/launch/slurm.py), tested here with the variables srun would set,
then a whole run as srun would start it: one launcher per task, on this machine."""

import json
import os
import subprocess
import sys

import pytest

from asyncfp8.chaos.audit import audit
from asyncfp8.chaos.cluster import SMALL_RUN
from asyncfp8.launch.processes import free_ports
from asyncfp8.launch.slurm import (
    expand_hostlist,
    expand_tasks_per_node,
    role_of,
    slurm_task,
)


def srun_env(procid: int, ntasks: int, nodelist: str, per_node: str, **extra) -> dict:
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_JOB_ID": "4242",
        **extra,
    }


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node7", ["node7"]),
        ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
        ("a[08-10]-ib", ["a08-ib", "a09-ib", "a10-ib"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("x[1,3],y[009-010]", ["x1", "x3", "y009", "y010"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


def test_tasks_per_node_expand_and_bad_lists_are_refused():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="cannot read 'two'"):
        expand_tasks_per_node("two")
    with pytest.raises(ValueError, match="cannot read the range 'a-b'"):
        expand_hostlist("n[a-b]")


def test_roles_learner_ranks_first_on_the_first_node_then_workers():
    # 6 tasks on 3 nodes, 2 each; a 3-rank learner spans node a01 and a02.
    roles = [
        role_of(slurm_task("auto", srun_env(i, 6, "a[01-03]", "2(x3)")), learner_procs=3)
        for i in range(6)
    ]
    assert [(r.kind, r.index) for r in roles] == [
        ("learner", 0),
        ("learner", 1),
        ("learner", 2),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
    ]
    assert {r.learner_host for r in roles} == {"a01"} and {r.workers for r in roles} == {3}
    ranks = [r.env for r in roles[:3]]
    assert [e["RANK"] for e in ranks] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in ranks] == ["0", "1", "0"]  # the third is a02's first
    assert [e["LOCAL_WORLD_SIZE"] for e in ranks] == ["2", "2", "1"]
    assert {e["WORLD_SIZE"] for e in ranks} == {"3"} and {e["MASTER_ADDR"] for e in ranks} == {
        "a01"
    }
    assert {e["MASTER_PORT"] for e in ranks} == {"33742"}  # 29500 + job id 4242 mod 10000
    assert roles[3].env == {}


def test_when_a_task_is_under_slurm_and_what_is_refused():
    assert slurm_task("auto", {}) is None  # not under srun: the launcher does it all
    assert slurm_task("auto", srun_env(0, 1, "n1", "1")) is None  # one task: the same
    assert slurm_task(False, srun_env(0, 4, "n1", "4")) is None
    assert slurm_task(True, srun_env(0, 1, "n1", "1")).ntasks == 1
    with pytest.raises(
        ValueError, match=r"run\.slurm=true but this process was not started by srun"
    ):
        slurm_task(True, {})
    with pytest.raises(ValueError, match=r"SLURM_DISTRIBUTION=cyclic.*--distribution=block"):
        slurm_task("auto", srun_env(0, 4, "n[1-2]", "2(x2)", SLURM_DISTRIBUTION="cyclic"))
    with pytest.raises(ValueError, match="they do not add up"):
        slurm_task("auto", srun_env(0, 5, "n[1-2]", "2(x2)"))
    with pytest.raises(ValueError, match=r"run\.slurm must be auto, true or false"):
        slurm_task("yes", {})
    too_few = slurm_task("auto", srun_env(0, 2, "n1", "2"))
    with pytest.raises(ValueError, match=r"2 task\(s\): too few for run.learner_procs=2"):
        role_of(too_few, learner_procs=2)


@pytest.mark.slow
def test_srun_of_the_launcher_runs_a_two_rank_learner_and_two_workers(tmp_path, tiny_model_dir):
    """Four tasks as srun starts them (one launcher each, with the variables srun sets):
    a two-rank learner (its process group from the variables asyncfp8 sets) and two
    workers; task 0 shows the progress and writes the summary; nothing lost."""
    run_dir = tmp_path / "run"
    # One call for all four: ports from separate calls can repeat once released.
    *ports, rendezvous_port = free_ports(4)
    overrides = [
        f"model.path={tiny_model_dir}",
        f"run.dir={run_dir}",
        *SMALL_RUN,
        "run.steps=4",
        "run.learner_procs=2",
        "eval.every=0",
        *(
            f"sync.{name}_port={port}"
            for name, port in zip(("version", "snapshot", "trajectory"), ports, strict=True)
        ),
    ]
    rendezvous = str(rendezvous_port)  # the job's MASTER_PORT, as many clusters set one
    tasks = [
        subprocess.Popen(
            [sys.executable, "-m", "asyncfp8.launch", *overrides],
            env={**os.environ, **srun_env(i, 4, "localhost", "4", MASTER_PORT=rendezvous)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(4)
    ]
    outputs = []
    try:
        for task in tasks:
            outputs.append(task.communicate(timeout=300)[0])
    finally:
        for task in tasks:
            task.kill()
    assert [t.returncode for t in tasks] == [0, 0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    assert "Slurm task 0 of 4 on localhost: learner" in outputs[0]
    assert "Slurm task 1 of 4 on localhost: learner-rank1" in outputs[1]
    assert "Slurm task 3 of 4 on localhost: worker-1" in outputs[3]
    assert "[launch] done in" in outputs[0] and "[launch] done in" not in outputs[2]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    assert "2 rank(s)" in (run_dir / "learner.log").read_text()
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.steps == 4 and result.lost == 0


def test_a_worker_task_that_exits_after_the_run_ended_is_not_restarted(tmp_path, capsys):
    """Under load a worker task may start after the learner finished; it then waits for a
    learner that is gone and exits 3, which once the run's summary is written is its end."""
    import time
    from types import SimpleNamespace

    from asyncfp8.launch.local import run_ended, wait_for

    restarted = []
    process = SimpleNamespace(
        name="worker-1",
        restarts=0,
        popen=SimpleNamespace(wait=lambda: 3),
        restart=lambda code: restarted.append(code),
    )
    since = time.time() - 1
    assert not run_ended(tmp_path, since)
    assert wait_for(process, restarts=0) == (process, 3)  # the run goes on: a failure
    (tmp_path / "summary.json").write_text("{}")
    assert run_ended(tmp_path, since) and not run_ended(tmp_path, time.time() + 60)
    assert wait_for(process, restarts=3, ended=lambda: run_ended(tmp_path, since)) is None
    assert restarted == [] and "exited with 3 after the run ended" in capsys.readouterr().out
