"""A run's records as it wrote them: `metrics.jsonl` (asyncfp8.report.metrics writes it, one
object per learner step) and the other JSON-lines files of `run.dir` (the ledger), read
back whole lines only. The writers and the readers (the report, the progress bar, the
chaos scenarios) both import this, not one another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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
