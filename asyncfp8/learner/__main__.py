"""python -m asyncfp8.learner [overrides...]: one learner process (or one rank under
torchrun). Exit codes: 0 done, 2 a bad setting (said at start), 1 a failure, 128+N
stopped by signal N (checkpointed: resume with run.resume=true)."""

import logging
import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8 import exit_on_version_flag
from asyncfp8.run import distributed
from asyncfp8.run.process import setup_logging
from asyncfp8.run.resume import log_resume, restore_on_resume
from asyncfp8.train.loss_scale import LossScaleOverflow

from .loop import Learner

log = logging.getLogger("asyncfp8.learner")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    rank = os.environ.get("RANK", "0")  # set by torchrun
    setup_logging("learner" if rank == "0" else f"learner-rank{rank}")
    try:
        cfg, changes = restore_on_resume(cfg, list(HydraConfig.get().overrides.task))
        log_resume(cfg, changes, "learner")
        learner = Learner(cfg)
    except (ValueError, FileNotFoundError, MemoryError) as err:
        log.error("%s", err)
        distributed.exit_process(2)  # the process group may have started: as below
    try:
        code = learner.run()
    except (MemoryError, LossScaleOverflow) as err:
        log.error("%s", err)
        code = 1
    distributed.exit_process(code)  # no finalization racing gloo's threads


if __name__ == "__main__":
    exit_on_version_flag()
    main()
