"""A run through the launcher, as a user starts it (`python -m asyncfp8.launch`), on the
small job (`SMALL_RUN`): what test_e2e, test_colocated and the session's shared runs in
tests/conftest.py launch."""

import subprocess
import sys

from asyncfp8.chaos.cluster import SMALL_RUN


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
