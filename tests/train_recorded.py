"""Trains the learner on recorded groups, as one process or under torchrun, and writes
the final parameters (gathered whole) for tests/test_learner.py to compare.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/train_recorded.py \\
        MODEL_DIR GROUPS_JSON RUN_DIR OUT_PT [overrides...]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.learner import Learner
from asyncfp8.run import distributed
from tests.recorded import learner_config, load_groups, train


def main() -> None:
    model_dir, groups_json, run_dir, out, *overrides = sys.argv[1:]
    learner = Learner(learner_config(Path(model_dir), Path(run_dir), *overrides))
    learner.version = 0
    metrics = [train(learner, groups) for groups in load_groups(Path(groups_json))]
    full = distributed.full_state_dict(learner.model)
    if learner.ranks.main:
        torch.save({"parameters": full, "metrics": metrics}, out)
    learner.close()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)  # as the learner ends: no finalization racing gloo
