"""A resumed run continues the run that was stopped: its settings come from the config the
learner saved in `<run.dir>/config.yaml`, not from today's defaults. Overrides apply on top
only where they do not change the experiment (each logged); any other is refused with the
keys named unless `run.force_resume=true` (docs/running.md, 'Checkpoints and resume').
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("asyncfp8.config")
CONFIG_FILE = "config.yaml"

# Settings a resumed run may change: length, logging, checkpoints, processes, addresses.
SAFE_ON_RESUME = (
    "run.steps",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.export_every",
    "run.slurm",
    "run.ray",
    "run.ray_address",
    "run.ray_learner.",
    "run.ray_worker.",
    "run.ray_timeout",
    "run.ray_learner_restarts",
    "run.tensorboard",
    "run.loggers",
    "run.wandb.",
    "run.workers",
    "run.worker_restarts",
    "run.threads",
    "run.worker_id",
    "run.worker_wait_timeout",
    "run.lease_timeout",
    "run.learner_procs",
    "run.dist_timeout",
    "run.device",
    # How a step's memory is bounded; the gradient is the same up to rounding.
    "optim.micro_batch_tokens",
    "optim.logprob_chunk_tokens",
    "optim.activation_checkpointing",
    "engine.device",
    "eval.every",
    "sync.",
    # The guard's bounds: what a run stopped by it resumes with when they are raised.
    "guard.",
)
# Not settings of the experiment at all: how to resume.
RESUME_KEYS = ("run.resume", "run.dir", "run.force_resume")
# Groups with one option each: a key the saved run lacks (added by a newer asyncfp8) takes
# today's default. Of the groups with several options, the saved option is kept and only
# the keys its schema defines are filled (`_schema_defaults`).
SINGLE_OPTION_GROUPS = ("run", "sync", "optim", "eval", "guard")


def _keys(overrides: list[str]) -> list[str]:
    """The config keys (or groups) a list of Hydra override strings sets."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)]


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def _select(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def save_config(cfg: DictConfig, run_dir: Path) -> Path:
    """The run's config (resolved) as `<run_dir>/config.yaml`, written beside it and
    renamed over it: the launcher's progress bar and `asyncfp8.report` read it while a
    resumed learner writes it again, and must never see half of it."""
    path = Path(run_dir) / CONFIG_FILE
    temporary = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    try:
        OmegaConf.save(cfg, temporary, resolve=True)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def saved_config(run_dir: Path) -> DictConfig:
    """The config a run saved, or a ValueError saying why there is none to resume."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        nearby = sorted(p.name for p in run_dir.parent.glob("*") if (p / CONFIG_FILE).is_file())
        raise ValueError(
            f"run.resume=true but run.dir={run_dir} does not exist"
            + (f"; runs in {run_dir.parent}: {', '.join(nearby[-5:])}" if nearby else "")
        )
    if not path.is_file():
        raise ValueError(
            f"run.resume=true but {run_dir} holds no {CONFIG_FILE}: it is not a run asyncfp8 "
            "started (point run.dir at the run to continue)"
        )
    return OmegaConf.load(path)


def restore_on_resume(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """(the config to run with, the changes applied on top of the saved run, as text).
    Without `run.resume` the composed config is returned unchanged."""
    if not cfg.run.resume:
        return cfg, []
    saved = saved_config(Path(cfg.run.dir))
    restored = OmegaConf.to_container(saved, resolve=False)
    composed = OmegaConf.to_container(cfg, resolve=False)
    filled: list[str] = []  # keys a newer asyncfp8 added take today's defaults, said
    for group in SINGLE_OPTION_GROUPS:
        if group in composed:
            restored[group] = _filled(restored.get(group, {}), composed[group], group, filled)
    for group, defaults in _schema_defaults(restored).items():
        restored[group] = _filled(restored[group], defaults, group, filled)
    for key, value in composed.items():
        restored.setdefault(key, value)
    result = OmegaConf.create(restored)

    given = [k for k in _keys(overrides) if not k.startswith(RESUME_KEYS)]
    refused = [k for k in given if not _safe(k) and _select(saved, k) != _select(cfg, k)]
    if refused and not cfg.run.force_resume:
        raise ValueError(
            f"run.resume=true continues the run in {cfg.run.dir} with its saved settings; "
            f"{', '.join(refused)} would change the experiment (saved: "
            + ", ".join(f"{k}={_select(saved, k)}" for k in refused)
            + "). Drop those overrides, start a new run.dir, or add run.force_resume=true."
        )
    changes = [f"{key}: absent from the saved run, now {value}" for key, value in filled]
    for key in given:
        before, after = _select(saved, key), _select(cfg, key)
        if before != after:
            OmegaConf.update(result, key, after, merge=False, force_add=True)
            changes.append(f"{key}: {before} -> {after}")
    for key in RESUME_KEYS:
        OmegaConf.update(result, key, _select(cfg, key), merge=False, force_add=True)
    OmegaConf.set_struct(result, True)
    return result, changes


def _filled(saved: dict, defaults: dict, prefix: str, filled: list) -> dict:
    """`saved` with every key of `defaults` it lacks, at every depth; (dotted key, value)
    of each added to `filled`."""
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
            filled.append((f"{prefix}.{key}", value))
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _filled(out[key], value, f"{prefix}.{key}", filled)
    return out


def _schema_defaults(saved: dict) -> dict[str, dict]:
    """For the saved run's engine, correction and precision: the defaults of the keys their
    schemas define (the engine's own schema; the keys every correction and every precision
    has), so that an option saved before a key existed resumes with that key's default."""
    import dataclasses

    from asyncfp8.conf.schemas import ENGINE_SCHEMAS
    from asyncfp8.correction.schema import CorrectionConfig
    from asyncfp8.precision.schema import PrecisionConfig

    def defaults_of(schema) -> dict:
        return OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)

    out = {}
    engine = saved.get("engine") or {}
    if engine.get("name") in ENGINE_SCHEMAS:
        out["engine"] = defaults_of(ENGINE_SCHEMAS[engine["name"]])
    for group, schema in (("correction", CorrectionConfig), ("precision", PrecisionConfig)):
        if group in saved:
            names = {f.name for f in dataclasses.fields(schema)} - {"name", "_target_"}
            out[group] = {k: v for k, v in defaults_of(schema).items() if k in names}
    return out


def log_resume(cfg: DictConfig, changes: list[str], who: str) -> None:
    if cfg.run.resume:
        log.info(
            "%s: resuming %s with its saved settings%s",
            who,
            cfg.run.dir,
            ("; changed: " + "; ".join(changes)) if changes else " (nothing changed)",
        )
