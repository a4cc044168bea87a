"""Tasks: prompt sources with their reward functions, chosen by name or Hydra config.

    from asyncfp8.tasks import get_task, build_task, register_task
    task = get_task("arithmetic", seed=1)
    task = build_task(cfg.task)   # Hydra: task=arithmetic, task.reward._target_=my.module.fn

A reward function is `reward(completion: str, answer: str) -> float`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .arithmetic import ArithmeticTask
from .base import Prompt, RewardFn, Task
from .gsm8k import GSM8KJsonlTask

_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task] | None = None):
    """Register `factory(**params) -> Task` under `name`; usable as a decorator."""

    def add(fn: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS and _TASKS[name] is not fn:
            raise ValueError(f"a task named {name!r} is already registered ({_TASKS[name]!r})")
        _TASKS[name] = fn
        return fn

    return add(factory) if factory is not None else add


def registered_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str, **params: Any) -> Task:
    if name not in _TASKS:
        raise ValueError(
            f"unknown task {name!r}; registered tasks: {', '.join(registered_tasks())}"
        )
    try:
        return _TASKS[name](**params)
    except TypeError as err:
        raise TypeError(f"task {name!r}: bad parameters {sorted(params)}: {err}") from None


def build_task(cfg: Mapping[str, Any]) -> Task:
    """A task from its config group entry: `name`, an optional `reward` node with a
    Hydra `_target_` (a function, extra keys become its keyword arguments), and the
    task's own parameters."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    if "name" not in params:
        raise ValueError(
            f"task config needs a 'name' (one of {', '.join(registered_tasks())}); got keys {sorted(params)}"
        )
    name = params.pop("name")
    reward_cfg = params.pop("reward", None)
    if reward_cfg is not None:
        try:
            params["reward"] = instantiate(reward_cfg, _partial_=True)
        except Exception as err:
            raise ValueError(
                f"task {name!r}: cannot load reward {reward_cfg.get('_target_')!r}: {err}"
            ) from None
    return get_task(name, **params)


register_task("arithmetic", ArithmeticTask)
register_task("gsm8k_jsonl", GSM8KJsonlTask)

__all__ = [
    "ArithmeticTask",
    "GSM8KJsonlTask",
    "Prompt",
    "RewardFn",
    "Task",
    "build_task",
    "get_task",
    "register_task",
    "registered_tasks",
]
