"""Every learner rank resumes from the same version, however slow one rank's restore is
(tests/checkpoint_ranks_check.py, two gloo ranks under torchrun)."""

import re
from pathlib import Path

import pytest

from tests.launched import two_ranks


@pytest.mark.slow
def test_a_slow_rank_resumes_from_the_version_the_others_do(tmp_path):
    """Rank 0 publishes its next version (rewriting `latest_version`) as soon as its own
    restore returns. Before the ranks agreed on the version, slow rank 1 then read rank
    0's new number and went on one version ahead: the colocated resume that failed with
    "rank 0 generates with version 10, this rank's engine holds 11"."""
    out = two_ranks(
        Path(__file__).with_name("checkpoint_ranks_check.py"), str(tmp_path), timeout=120
    )
    versions = dict(re.findall(r"rank (\d): restored version (\d+)", out))
    # 7: what the killed learner reserved, past the checkpoint's 5
    assert versions == {"0": "7", "1": "7"}, out[-3000:]
