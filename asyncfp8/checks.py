"""The whole config checked before any process binds a socket or loads a model: the
launcher runs it before it starts anything, the learner and every worker at their start,
so a bad setting is named within seconds instead of surfacing as a crash in one log.

What it builds on the way (the precision policy, the correction, the task with its reward)
is returned, so the caller does not build them twice."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from asyncfp8.correction import Correction, build_correction
from asyncfp8.precision import PrecisionPolicy, build_policy
from asyncfp8.process import check_counts, curve, endpoints
from asyncfp8.tasks import Task, build_task

TENSORBOARD_INSTALL = 'pip install -c constraints.txt -e ".[tensorboard]"'
SCHEDULES = ("constant", "cosine")


@dataclass
class Checked:
    policy: PrecisionPolicy
    correction: Correction
    task: Task


def max_staleness_of(run: Any) -> int:
    """The staleness bound the run trains under (0 in sync mode)."""
    if run.mode not in ("async", "sync"):
        raise ValueError(f"run.mode must be async or sync, got {run.mode!r}")
    if run.mode == "sync":
        return 0
    if run.max_staleness is None or run.max_staleness < 0:
        raise ValueError(f"run.max_staleness must be >= 0, got {run.max_staleness!r}")
    return int(run.max_staleness)


def check_config(cfg: DictConfig, model_dir: str | Path, role: str) -> Checked:
    """ValueError naming the setting (and what to do) for the first problem found;
    `role` is "launcher", "learner" or "worker"."""
    run = cfg.run
    check_counts(cfg)
    max_staleness_of(run)
    if run.group_size < 2:
        raise ValueError(
            f"run.group_size must be >= 2 (GRPO compares samples of a prompt), got {run.group_size}"
        )
    if role == "launcher" and (not isinstance(run.workers, int) or run.workers < 1):
        raise ValueError(
            f"run.workers must be >= 1 for the launcher (it starts them), got {run.workers!r}"
        )
    if cfg.optim.schedule not in SCHEDULES:
        raise ValueError(
            f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {cfg.optim.schedule!r}"
        )
    if run.tensorboard not in (True, False, "auto"):
        raise ValueError(f"run.tensorboard must be true, false or auto, got {run.tensorboard!r}")
    if run.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            f"run.tensorboard=true but TensorBoard is not installed: {TENSORBOARD_INSTALL} "
            "(or run.tensorboard=auto: use it when it is there)"
        )
    endpoints(cfg.sync, "bind" if role == "learner" else "connect")
    curve(cfg.sync)
    policy = build_policy(cfg.precision, model_dir)
    reason = policy.supported_by(cfg.engine.name)
    if reason:
        raise ValueError(f"engine {cfg.engine.name} cannot run precision {policy.name!r}: {reason}")
    return Checked(policy, build_correction(cfg.correction), build_task(cfg.task))
