"""Two colocated ranks' rollouts without the learner, under torchrun (gloo):

    torchrun --nproc_per_node 2 tests/colocated_ranks_check.py MODEL_DIR sync|async

Rank 1's engine fails its part of the first lease; rank 0 must stop its rollouts naming
that rank and why, and rank 1 must hear that they stopped (tests/test_colocated.py reads
what each rank prints)."""

import sys
import time

from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.learner.colocated import LEASE, Colocated, RolloutFailed
from asyncfp8.learner.inbox import Inbox
from asyncfp8.learner.leases import LeaseBook
from asyncfp8.precision import get_policy
from asyncfp8.run import distributed
from asyncfp8.tasks import build_task
from tests.config import compose


class BrokenEngine:
    version = 1

    def generate(self, prompts, sampling, first_request=0):
        raise ValueError("the engine broke")

    def close(self):
        pass


def main(model_dir: str, mode: str) -> None:
    ranks = distributed.start("cpu", 60)
    cfg = compose(f"model.path={model_dir}", f"run.mode={mode}", "sync.probe.enabled=false")
    task = build_task(cfg.task, model_dir)
    group = distributed.new_group(60) if mode == "async" else None
    if ranks.main:
        engine = TorchEngine(model_dir, "bf16")
        engine.version = 1  # the weights it loaded, as version 1
    else:
        engine = BrokenEngine()
    colocated = Colocated(cfg, engine, task, get_policy("bf16"), ranks.rank, 2, group)
    if ranks.main:
        sampling = {"n": 2, "temperature": 1.0, "max_new_tokens": 4}
        inbox = Inbox(None, LeaseBook(capacity=8, timeout=60), 2, sampling, 0, None)
        inbox.trained(0, 1)  # version 1 is out: work may be leased
        colocated.start(inbox)
        deadline = time.monotonic() + 60
        while mode == "async" and colocated.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            colocated.fill(inbox, 4)
            print("rank 0: no failure")
        except RolloutFailed as err:
            print(f"rank 0: {err}")
        if mode == "sync":
            distributed.scatter([("stop", None)] * 2)  # as the hub does
        colocated.close()
    else:
        colocated.start(None)
        if mode == "sync":
            message = distributed.scatter(None)
            while message[0] == LEASE:
                colocated.follow(message)
                message = distributed.scatter(None)
        colocated.stop(timeout=60)
        alive = colocated._thread is not None and colocated._thread.is_alive()
        print(f"rank 1: stopped (thread alive: {alive}), error {colocated.error!r}")
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    distributed.exit_process(0)  # as the learner ends: no finalization racing gloo
