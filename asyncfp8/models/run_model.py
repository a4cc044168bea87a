"""Which model a run uses: the directory its config names (checked), or the locally made
tiny model of the size, seed and task it asks for."""

from __future__ import annotations

from pathlib import Path

from asyncfp8.hf.directory import check_model_dir


def resolve_model_dir(path: str | None, size: str = "tiny", seed: int = 0, task=None) -> Path:
    """The model a run uses: `path` when given (checked), else the locally made tiny
    model of that size and seed, warm-started on the run's task config `task` where the
    factory knows how (asyncfp8.models.tiny.warm_start_task): shipped with the package,
    or built on first use and cached."""
    if path:
        return check_model_dir(path)
    # imported here: `python -m asyncfp8.models.tiny` must not find it imported already
    from .tiny import make_tiny_model, warm_start_task

    return make_tiny_model(size, seed=seed, task=warm_start_task(task))


def run_model_dir(cfg) -> Path:
    """The model directory of a run's config (`model` and `task` groups)."""
    return resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed, cfg.task)
