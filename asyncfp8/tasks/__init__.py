"""Tasks: prompt sources with their reward functions, chosen by name or Hydra config.

    task = build_task(cfg.task, model_dir=model_dir)  # or get_task("addition", digits=3)

A reward function is `reward(completion: str, answer: str) -> float` (docs/running.md, 'Tasks').
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .addition import AdditionTask
from .arithmetic import ArithmeticTask
from .base import Prompt, RewardFn, Task
from .dataset import DatasetTask
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


def build_reward(task_name: str, reward_cfg: Mapping[str, Any]) -> RewardFn:
    """`reward(completion, answer)` from a `task.reward` node: `_target_` names a function,
    the other keys are its keyword arguments. Refused here, naming the function, if it
    cannot be called with (completion, answer) and those arguments."""
    from hydra.utils import get_object

    kwargs = dict(reward_cfg)
    target = kwargs.pop("_target_", None)
    if not target:
        raise ValueError(
            f"task {task_name!r}: task.reward needs a _target_ (package.module.function)"
        )
    try:
        fn = get_object(target)
    except Exception as err:
        raise ValueError(
            f"task {task_name!r}: cannot load reward {target!r} ({err}); is its module on "
            "PYTHONPATH for the learner and every worker?"
        ) from None
    if not callable(fn):
        raise ValueError(f"task {task_name!r}: reward {target!r} is {fn!r}, not a function")
    try:
        inspect.signature(fn).bind("completion", "answer", **kwargs)
    except TypeError as err:
        shown = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        raise ValueError(
            f"task {task_name!r}: reward {target} cannot be called as "
            f"{target.rsplit('.', 1)[-1]}(completion, answer{shown}): {err}"
        ) from None
    except ValueError:  # a builtin without a signature: the trial call in build_task decides
        pass
    return functools.partial(fn, **kwargs) if kwargs else fn


def _takes_model_dir(factory: Callable[..., Task]) -> bool:
    try:
        return "model_dir" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C factory: it takes what it is given
        return False


def build_task(cfg: Mapping[str, Any], model_dir: str | Path | None = None) -> Task:
    """A task from its config group entry: `name`, an optional `reward` node with a Hydra
    `_target_` (a function; extra keys become its keyword arguments), and the task's own
    parameters. A task that takes a `model_dir` (task=dataset's chat template) is given the
    run's. The reward is tried once on the first prompt, so that a reward that fails does so
    at start, not at the first scoring in a worker."""
    from omegaconf import DictConfig, OmegaConf

    plain = isinstance(cfg, DictConfig)
    params = OmegaConf.to_container(cfg, resolve=True) if plain else dict(cfg)
    if "name" not in params:
        raise ValueError(
            f"task config needs a 'name' (one of {', '.join(registered_tasks())}); "
            f"got keys {sorted(params)}"
        )
    name = params.pop("name")
    reward_cfg = params.pop("reward", None)
    if reward_cfg is not None:
        params["reward"] = build_reward(name, reward_cfg)
    if model_dir is not None and name in _TASKS and _takes_model_dir(_TASKS[name]):
        params.setdefault("model_dir", str(model_dir))
    task = get_task(name, **params)
    prompt = task.prompt(0)
    completion = task.completion(prompt) if hasattr(task, "completion") else ""
    try:
        task.score(completion, prompt)
    except Exception as err:
        raise ValueError(
            f"task {name!r}: the reward failed on a trial call with the first prompt's "
            f"reference completion: {type(err).__name__}: {err}"
        ) from None
    return task


register_task("addition", AdditionTask)
register_task("arithmetic", ArithmeticTask)
register_task("gsm8k_jsonl", GSM8KJsonlTask)
register_task("dataset", DatasetTask)

__all__ = [
    "AdditionTask",
    "ArithmeticTask",
    "DatasetTask",
    "GSM8KJsonlTask",
    "Prompt",
    "RewardFn",
    "Task",
    "build_task",
    "get_task",
    "register_task",
    "registered_tasks",
]
