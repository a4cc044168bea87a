"""The run's one progress bar, fed by the learner's metrics file as it grows (the
launcher, the Ray driver and the chaos harness show it): steps, the held-out pass@1 from
its first evaluation to its latest, the stream reward, the mismatch, staleness, the
guard's rollbacks and the refit probe."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

from tqdm import tqdm

from asyncfp8.report.summary import ZERO_SPREAD_WARN, ZERO_SPREAD_WINDOW
from asyncfp8.run.records import METRICS_FILE


class Progress:
    """The run's one progress bar, fed by the learner's metrics file."""

    def __init__(self, run_dir: Path, steps: int, start: int = 0):
        self.path = run_dir / METRICS_FILE
        self.bar = tqdm(total=steps, initial=start, desc="steps", unit="step", dynamic_ncols=True)
        self._start_reading(file=None)

    def _start_reading(self, file: tuple[int, int] | None) -> None:
        """Reads `file` (device, inode) from its start: at the start, and when a resumed
        learner has replaced the metrics file with one cut back to its checkpoint (an
        offset into the old file means nothing in the new one)."""
        self.file, self.offset = file, 0
        self.last: dict = {}
        # Recent steps' share of groups without reward spread.
        self.zero_spread: deque[float] = deque(maxlen=ZERO_SPREAD_WINDOW)
        # Held-out greedy pass@1: the first evaluation (before training) and the latest.
        self.eval_start: float | None = None
        self.eval: float | None = None
        self.heldout_rollbacks = 0  # evaluations the guard undid (guard.heldout_below)

    def update(self) -> None:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return
        with f:
            # The identity of the file this handle reads, not of whatever the path names
            # a moment later: the learner replaces it by a rename.
            stat = os.fstat(f.fileno())
            if (stat.st_dev, stat.st_ino) != self.file or stat.st_size < self.offset:
                replaced = self.file is not None
                self._start_reading((stat.st_dev, stat.st_ino))
                if replaced:
                    self.bar.reset(total=self.bar.total)
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill, then written past: skipped
                continue
            self.bar.update(max(0, record["step"] - self.bar.n))
            self.last = record
            # a training step (not the step-0 evaluation)
            if "groups/frac_zero_advantage" in record:
                self.zero_spread.append(record["groups/frac_zero_advantage"])
            if record.get("eval/pass1_greedy") is not None:
                self.eval = record["eval/pass1_greedy"]
                self.heldout_rollbacks = record.get("guard/heldout_rollbacks", 0)
                if self.eval_start is None:
                    self.eval_start = self.eval
        if self.last:
            r = self.last
            # The held-out number first: what the run learned, not what it memorized.
            extra = {}
            if self.eval is not None:
                extra["heldout"] = f"{self.eval_start:.3f}->{self.eval:.3f}"
            if (
                len(self.zero_spread) == ZERO_SPREAD_WINDOW
                and sum(self.zero_spread) / ZERO_SPREAD_WINDOW > ZERO_SPREAD_WARN
            ):
                extra["warn"] = "most groups without reward spread"
            if r.get("guard/rollbacks"):  # steps the guard undid (asyncfp8/train/rollback.py)
                extra["rollbacks"] = int(r["guard/rollbacks"])
            if self.heldout_rollbacks:  # evaluations it undid (guard.heldout_below)
                extra["heldout_rollbacks"] = int(self.heldout_rollbacks)
            if r.get("refit/probe_mean_abs_dlogp") is not None:  # asyncfp8/refit/probe.py
                extra["probe"] = f"{r['refit/probe_mean_abs_dlogp']:.1e}"
                if r.get("refit/failures"):
                    extra["refit_failures"] = int(r["refit/failures"])
            self.bar.set_postfix(
                **extra,
                v=r.get("version"),
                reward=f"{r.get('reward/mean', float('nan')):.3f}",
                kl=f"{r.get('mismatch/kl_k3', float('nan')):.1e}",
                stale=f"{r.get('staleness/mean', float('nan')):.2f}",
                tok_s=f"{r.get('throughput/tokens_per_s', 0):.0f}",
                refresh=False,
            )

    def close(self) -> None:
        self.bar.close()
