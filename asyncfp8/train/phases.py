"""Where the learner's step goes: seconds per phase (`time/phase/<name>_s` in each step's
metrics: the step's share preparation and π_prox, forward, backward, guard, optimizer, and
the loop's publish, held-out evaluation and checkpoint), as `run.phase_times` asks. On a
GPU each boundary waits for the device (true only): without it, the host's launch time is
all a clock could see, so auto times the CPU alone, where timing costs nothing."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

PHASE_TIMES = ("auto", "true", "false")


class PhaseClock:
    def __init__(self, setting: object, device: torch.device):
        text = str(setting).lower()
        if text not in PHASE_TIMES:
            raise ValueError(f"run.phase_times must be auto, true or false, got {setting!r}")
        cuda = device.type == "cuda"
        self.on = text == "true" or (text == "auto" and not cuda)
        self.synchronize = self.on and cuda
        self.device = device
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Adds the time of the block to `phase` (nested phases count in both)."""
        if not self.on:
            yield
            return
        self._wait()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._wait()
            self.seconds[phase] += time.perf_counter() - started

    def take(self) -> dict[str, float]:
        """The phases timed since the last take, as metrics; then starts again."""
        taken = {f"time/phase/{name}_s": s for name, s in sorted(self.seconds.items())}
        self.seconds.clear()
        return taken

    def _wait(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
