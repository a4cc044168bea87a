"""A real Slurm cluster (issue 47): Debian's munged, slurmctld and slurmd started by the
fixture; `sbatch` of examples/slurm/asyncfp8.sbatch runs a two-rank learner and two
workers as four tasks through asyncfp8/launch/slurm.py. Marked `cluster`: CI runs it on a line
of its own, after `apt-get install slurmctld slurmd slurm-client munge`."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncfp8.chaos.audit import audit
from asyncfp8.chaos.cluster import SMALL_RUN
from tests.cluster.ray_nodes import wait_for_step
from tests.cluster.slurm_daemons import SlurmDaemons, unavailable

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "slurm" / "asyncfp8.sbatch"


def task_processes(slurm_conf: str, module: str) -> dict[int, int]:
    """{Slurm task id: pid} of the `python -m <module>` processes of this cluster's jobs
    (slurmstepd runs detached from slurmd: they are found by their environment)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                entry.split(b"=", 1)
                for entry in (proc / "environ").read_bytes().split(b"\0")
                if b"=" in entry
            )
        except OSError:
            continue
        if module.encode() in argv and environ.get(b"SLURM_CONF") == slurm_conf.encode():
            found[int(environ[b"SLURM_PROCID"])] = int(proc.name)
    return found


def test_sbatch_of_the_example_script_runs_four_tasks_and_survives_a_killed_worker(
    tmp_path, tiny_model_dir
):
    """30 steps as sbatch runs them. At step 8 the worker of task 3 is killed (SIGKILL,
    as the OOM killer or a failing node does): its task starts it again, the run
    finishes, and every prompt was trained once."""
    run_dir = tmp_path / "run"
    with SlurmDaemons(tmp_path / "slurm", cpus=4) as slurm:
        job = subprocess.Popen(
            [
                "sbatch",
                "--wait",
                f"--chdir={REPO}",
                f"--output={tmp_path / 'job.out'}",
                str(SCRIPT),
                f"model.path={tiny_model_dir}",
                *SMALL_RUN,
                "run.steps=30",
                "eval.every=0",
            ],
            env={**slurm.env, "PYTHON": sys.executable, "RUN_DIR": str(run_dir)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for_step(run_dir, 8, job)
            conf = slurm.env["SLURM_CONF"]
            workers = task_processes(conf, "asyncfp8.worker")
            assert sorted(workers) == [2, 3], workers  # tasks 0 and 1 are the learner's ranks
            assert sorted(task_processes(conf, "asyncfp8.learner")) == [0, 1]
            os.kill(workers[3], signal.SIGKILL)
            submitted = job.communicate(timeout=300)[0]
        finally:
            job.kill()
        output = (tmp_path / "job.out").read_text()
        assert job.returncode == 0, f"{submitted}\n{output[-3000:]}\n{slurm.logs()}"
    assert "Slurm task 0 of 4" in output and "Slurm task 3 of 4" in output
    assert "worker-1 exited with -9; restart 1/3" in output, output[-3000:]
    assert "[launch] done in" in output
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30
    assert "2 rank(s)" in (run_dir / "learner.log").read_text()
    result = audit(run_dir, group_size=4, max_staleness=1)
    assert result.steps == 30 and result.lost == 0, result
