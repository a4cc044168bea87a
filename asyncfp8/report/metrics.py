"""Where a run's numbers go (`run.loggers`): a JSONL file always (one object per learner
step; the launcher's progress bar, the plots and the report read it), TensorBoard and
Weights & Biases when asked for."""

from __future__ import annotations

import importlib
import json
import logging
import math
import netrc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncfp8.report.plots import plot_runs
from asyncfp8.report.summary import summarize
from asyncfp8.run.failpoints import write_line
from asyncfp8.run.records import METRICS_FILE, read_jsonl

log = logging.getLogger("asyncfp8.report.metrics")
LOGGERS = ("jsonl", "tensorboard", "wandb")
INSTALL = {
    "tensorboard": 'pip install "asyncfp8[tensorboard]" (in a clone: pip install -c '
    'constraints.txt -e ".[tensorboard]")',
    "wandb": 'pip install "asyncfp8[wandb]" (in a clone: pip install -c constraints.txt -e '
    '".[wandb]")',
}
WANDB_DIR = "wandb"  # <run.dir>/wandb/: W&B's own folder (offline-run-*, run-*, logs)
WANDB_ID_FILE = "asyncfp8_run_id"  # in WANDB_DIR: the W&B run a resumed run continues
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass(frozen=True)
class WandbSettings:
    """`run.wandb`: where the W&B run goes; `name` None is the name of run.dir."""

    project: str = "asyncfp8"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    mode: str = "auto"


@dataclass(frozen=True)
class Loggers:
    """What `run.loggers` and the older `run.tensorboard` ask for, checked. `tensorboard`
    is True, False or "auto" (when installed); JSONL is always written."""

    tensorboard: bool | str = "auto"
    wandb: bool = False
    wandb_settings: WandbSettings = field(default_factory=WandbSettings)


def loggers_of(run: Any) -> Loggers:
    """`run.loggers`, `run.tensorboard` and `run.wandb` checked: a ValueError naming the
    setting (and the install command) for an unknown logger or a tracker that is not
    installed."""
    names = run.loggers
    if isinstance(names, str):  # run.loggers=wandb
        names = [names]
    if not isinstance(names, Sequence):
        raise ValueError(f"run.loggers must be a list of {', '.join(LOGGERS)}, got {names!r}")
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ValueError(
            f"run.loggers: unknown logger {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(LOGGERS)}, e.g. run.loggers=[jsonl,wandb] (jsonl is always written)"
        )
    tensorboard = run.tensorboard
    if "tensorboard" in names:
        if tensorboard is False:
            raise ValueError(
                "run.loggers names tensorboard but run.tensorboard=false: drop one of them"
            )
        tensorboard = True
    for name in ("tensorboard", "wandb"):
        if name in names and not _importable(name):
            raise ValueError(
                f"run.loggers names {name}, which is not installed: {INSTALL[name]}, or drop "
                f"it from run.loggers"
            )
    return Loggers(tensorboard, "wandb" in names, wandb_settings_of(run.wandb))


def wandb_settings_of(node: Any) -> WandbSettings:
    """`run.wandb` checked; absent (a run saved before it existed): the defaults."""
    given = dict(node or {})
    unknown = sorted(set(given) - set(WandbSettings.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"run.wandb has no setting {', '.join(unknown)}; it has "
            f"{', '.join(WandbSettings.__dataclass_fields__)}"
        )
    given["tags"] = tuple(given.get("tags") or ())
    settings = WandbSettings(**given)
    if settings.mode not in WANDB_MODES:
        raise ValueError(
            f"run.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {settings.mode!r}"
        )
    if not settings.project:
        raise ValueError("run.wandb.project must be set (a W&B project name)")
    return settings


def _importable(module: str) -> bool:
    """Imported, not only found: a module present but broken (or blocked) counts as missing."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def wandb_mode(setting: str, environ: Mapping[str, str]) -> str:
    """run.wandb.mode=auto: the user's WANDB_MODE if set, else online when an API key is
    there (WANDB_API_KEY, or a ~/.netrc entry as `wandb login` writes), else offline: a
    run without a key never tries the network and can be uploaded later with `wandb sync`."""
    if setting != "auto":
        return setting
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if has_wandb_key(environ) else "offline"


def has_wandb_key(environ: Mapping[str, str]) -> bool:
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


class WandbRun:
    """The learner's W&B run (rank 0's): the resolved config attached, one history row per
    learner step (the W&B step is the learner step), and at the end the run's summary and
    plots. Its local folder is `<run.dir>/wandb/`; its id is kept there so that a resumed
    run (run.resume=true) continues the same W&B run."""

    def __init__(
        self,
        run_dir: Path,
        settings: WandbSettings,
        config: dict[str, Any] | None,
        resumed: bool,
    ):
        import wandb

        self.run_dir = run_dir
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
        mode = wandb_mode(settings.mode, os.environ)
        # W&B's own log lines (the whole config among them) go to its folder's
        # logs/debug.log, not to the learner's log.
        logging.getLogger("wandb").propagate = False
        try:
            self.run = wandb.init(
                dir=str(run_dir),  # W&B adds the wandb/ itself
                project=settings.project,
                entity=settings.entity,
                name=settings.name or run_dir.name,
                group=settings.group,
                tags=list(settings.tags) or None,
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
                mode=mode,
            )
        except wandb.errors.Error as err:
            raise ValueError(
                f"run.loggers: W&B could not start a run ({mode}): {err}. Check run.wandb "
                "(project, entity) and your key, or run offline: WANDB_MODE=offline"
            ) from None
        id_file.write_text(self.run.id + "\n")
        if mode == "offline":
            log.info(
                "W&B run %s, offline (no API key, or WANDB_MODE=offline), in %s; upload it "
                "with: wandb sync %s",
                self.run.id,
                self.run.settings.sync_dir,
                folder / "offline-run-*",
            )
        else:
            log.info("W&B run %s (%s): %s", self.run.id, mode, self.run.url)

    def write(self, step: int, record: dict[str, Any]) -> None:
        numbers = {
            key: value
            for key, value in record.items()
            if key != "step" and isinstance(value, int | float)
        }
        self.run.log(numbers, step=step)

    def close(self) -> None:
        try:
            self.attach_report()
        # Any error: the run is trained and saved by now, a missing summary must not fail it.
        except Exception as err:
            log.warning("W&B: the summary and plots were not attached: %r", err)
        finally:
            self.run.finish()

    def attach_report(self) -> None:
        """The run's summary and plots, as the launcher makes them after the learner exits.
        The learner owns this W&B run, so it computes both itself from the same
        metrics.jsonl before finishing, rather than a second process reopening the run
        (offline, a second folder to sync); this also serves a run without the launcher.
        The launcher's summary.json adds only its wall time (`wall_s`)."""
        import wandb

        try:
            summary = summarize(self.run_dir)
        except ValueError as err:  # stopped before its first step: nothing to summarize
            log.info("W&B: no summary attached (%s)", err)
            return
        self.run.summary.update({f"summary/{key}": _plain(v) for key, v in summary.items()})
        files = Path(self.run.dir)  # the W&B run's own files: synced with it
        (files / "summary.json").write_text(
            json.dumps({key: _plain(v) for key, v in summary.items()}, indent=2)
        )
        plot = plot_runs([self.run_dir], files / "plots.png")
        self.run.summary["plots"] = wandb.Image(str(plot))
        for name in ("summary.json", "plots.png"):
            self.run.save(str(files / name), base_path=str(files), policy="now")


class MetricsLog:
    """`resumed_step`: a resumed learner cuts the records past its checkpoint (those steps
    are trained again), as the ledger does, so that every step is in the file once."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool | str = "auto",
        resumed_step: int | None = None,
        wandb: WandbSettings | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resumed_step]
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(temporary, self.path)
        self._tensorboard = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                if tensorboard != "auto":
                    raise
                log.info("tensorboard is not installed: metrics go to %s only", self.path)
        self._wandb = None
        if wandb is not None:
            self._wandb = WandbRun(Path(run_dir), wandb, config, resumed_step is not None)
        self._file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines

    @classmethod
    def for_run(cls, cfg: Any, resumed_step: int | None = None) -> MetricsLog:
        """The loggers `cfg.run` asks for (`run.loggers`, `run.tensorboard`, `run.wandb`),
        with the resolved config attached to the W&B run."""
        from omegaconf import OmegaConf

        loggers = loggers_of(cfg.run)
        return cls(
            cfg.run.dir,
            loggers.tensorboard,
            resumed_step,
            wandb=loggers.wandb_settings if loggers.wandb else None,
            config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
            if loggers.wandb
            else None,
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step} | {key: _plain(value) for key, value in metrics.items()}
        write_line(self._file, json.dumps(record) + "\n", "metrics.mid_line")
        if self._tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.write(step, record)

    def close(self) -> None:
        self._file.close()  # first: the W&B summary is computed from the whole file
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.close()


def wandb_sync_hint(run_dir: str | Path) -> str | None:
    """The command that uploads a run's offline W&B folders, if it has any."""
    folder = Path(run_dir) / WANDB_DIR
    if not any(folder.glob("offline-run-*")):
        return None
    return f"wandb sync {folder}/offline-run-*"


def _plain(value: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
