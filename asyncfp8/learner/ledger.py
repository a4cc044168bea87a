"""The learner's ledger, `<run.dir>/ledger.jsonl`: per step, the version trained and each group
trained (`[lease, prompt, [[sender, seq, oldest_version], ...]]`), dropped as too stale or
skipped (dynamic sampling). It is how a run proves that no trajectory was trained twice and
no prompt lost (`asyncfp8.chaos.audit`, docs/reliability.md); a resumed learner cuts the
records past its checkpoint, whose steps are trained again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from asyncfp8.run.failpoints import write_line
from asyncfp8.run.records import read_jsonl

LEDGER_FILE = "ledger.jsonl"


class Ledger:
    def __init__(self, run_dir: str | Path, resumed_step: int | None = None):
        self.path = Path(run_dir) / LEDGER_FILE
        if resumed_step is not None and self.path.exists():
            kept = [r for r in read_ledger(run_dir) if r["step"] <= resumed_step]
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(temporary, self.path)
        self._file = self.path.open("a", buffering=1)  # whole lines reach the kernel at once

    def write(self, step: int, version: int, groups, dropped, skipped=()) -> None:
        record = {
            "step": step,
            "time": time.time(),
            "version": version,
            "groups": [_group(g) for g in groups],
            "dropped": [list(d) for d in dropped],
            "skipped": [_group(g) for g in skipped],
        }
        write_line(self._file, json.dumps(record) + "\n", "ledger.mid_line")

    def close(self) -> None:
        self._file.close()


def _group(g) -> list:
    return [
        g.lease,
        g.prompt,
        [[t.sender, t.seq, min(t.versions, default=0)] for t in g.trajectories],
    ]


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The complete records (a line cut short by a kill is left out)."""
    return read_jsonl(Path(run_dir) / LEDGER_FILE)
