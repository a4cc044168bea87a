"""A run through the launcher, as a user starts it (`python -m asyncfp8.launch`), on the
small job (`SMALL_RUN`): what test_e2e, test_colocated and the session's shared runs in
tests/conftest.py launch; and the launcher's refusal of a config, checked in this
process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncfp8.chaos.cluster import SMALL_RUN
from tests.config import compose


def launch(tmp_path, model_dir, *overrides, timeout=400, env=None):
    """(run dir, the launcher's output) of a run that must end with exit code 0."""
    run_dir = tmp_path / "launched"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncfp8.launch",
            f"model.path={model_dir}",
            f"run.dir={run_dir}",
            *SMALL_RUN,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, result.stdout


def two_ranks(script: Path, *args: str, timeout: int) -> str:
    """What a check script printed (stdout and stderr) run as two gloo ranks under torchrun,
    which must end with exit code 0; the repository on PYTHONPATH so that it imports
    `tests`."""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"PYTHONPATH": str(repo)},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


def refusal(model_dir, run_dir, *overrides) -> str:
    """The message of the launcher's refusal of these settings at start, before any process
    starts: its own check (`asyncfp8.launch.local.check_start`) in this process, which costs
    no Python start. What the launcher does with the message (exit 2, no traceback,
    within seconds) is checked once, on a real launch, in
    `tests/test_run_lifecycle.py::test_a_bad_setting_stops_the_launcher_at_start`."""
    from asyncfp8.launch.local import check_start

    cfg = compose(f"model.path={model_dir}", f"run.dir={run_dir}", *SMALL_RUN, *overrides)
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        check_start(cfg)
    return str(refused.value)
