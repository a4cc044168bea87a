"""Two learner ranks restoring one checkpoint, under torchrun (gloo):

    torchrun --nproc_per_node 2 tests/checkpoint_ranks_check.py RUN_DIR

A killed learner had reserved version 7 (`latest_version`) after its checkpoint saved
version 5. Rank 1 is slow to restore (its scheduler's state loads for a second); rank 0,
done first, publishes its next version at once, as the learner does, and so rewrites
`latest_version` to 8 while rank 1 is still restoring. Both ranks must go on from
version 7, or the colocated engines disagree on the version at the first lease
(tests/test_checkpoint_ranks.py reads what each rank prints)."""

import sys
import time
from pathlib import Path

import torch

from asyncfp8.learner.checkpoints import Checkpointer
from asyncfp8.run import distributed
from asyncfp8.run.files import LATEST_VERSION_FILE


class SlowToLoad(torch.optim.lr_scheduler.LambdaLR):
    def load_state_dict(self, state_dict):
        time.sleep(1.0)
        super().load_state_dict(state_dict)


def main(run_dir: str) -> None:
    ranks = distributed.start("cpu", 60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = SlowToLoad if ranks.rank == 1 else torch.optim.lr_scheduler.LambdaLR
    scheduler = schedule(optimizer, lambda step: 1.0)
    checkpointer = Checkpointer(Path(run_dir), model, optimizer, scheduler, ranks, keep=2)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    checkpointer.save(step=3, version=5, inbox={"book": {"next_prompt": 0}}, elapsed_s=1.0)
    latest = Path(run_dir) / LATEST_VERSION_FILE
    if ranks.main:
        latest.write_text("7")  # the killed learner reserved 6 and 7 after its save
    distributed.broadcast()  # the file is written before any rank restores
    restored = checkpointer.restore()
    if ranks.main:
        latest.write_text(str(restored.version + 1))  # its next publish, at once
    print(f"rank {ranks.rank}: restored version {restored.version}", flush=True)
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1])
    distributed.exit_process(0)  # as the learner ends: no finalization racing gloo
