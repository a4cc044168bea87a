"""Every learner rank resumes from the same version, however slow one rank's restore is
(tests/checkpoint_ranks_check.py, two gloo ranks under torchrun)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_slow_rank_resumes_from_the_version_the_others_do(tmp_path):
    """Rank 0 publishes its next version (rewriting `latest_version`) as soon as its own
    restore returns. Before the ranks agreed on the version, slow rank 1 then read rank
    0's new number and went on one version ahead: the colocated resume that failed with
    "rank 0 generates with version 10, this rank's engine holds 11"."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(REPO / "tests" / "checkpoint_ranks_check.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    versions = dict(re.findall(r"rank (\d): restored version (\d+)", out))
    # 7: what the killed learner reserved, past the checkpoint's 5
    assert versions == {"0": "7", "1": "7"}, out[-3000:]
