"""Where a run's numbers go: a JSONL file always (one object per learner step, the
launcher's progress bar and the report read it), TensorBoard too when it is installed."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncfp8.metrics")
METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """`resumed_step`: a resumed learner cuts the records past its checkpoint (those steps
    are trained again), as the ledger does, so that every step is in the file once."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool | str = "auto",
        resumed_step: int | None = None,
    ):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r["step"] <= resumed_step]
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(temporary, self.path)
        self._file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines
        self._tensorboard = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                if tensorboard != "auto":
                    raise
                log.info("tensorboard is not installed: metrics go to %s only", self.path)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step} | {key: _plain(value) for key, value in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _plain(value: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a run (a line being written is left out)."""
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` (one being written, or cut short by a kill, is
    left out); none if it does not exist."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
