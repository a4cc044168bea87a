"""Hard limits on what a receiver accepts, the one exception every rejection raises,
and the log that says why each message was rejected."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass


class RejectedMessage(ValueError):
    """A message that failed validation; the receiver logs the reason and goes on."""


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 1 << 30  # also set as ZMQ_MAXMSGSIZE on receiving sockets
    max_header_bytes: int = 16 << 20
    max_tensors: int = 1 << 16  # per message
    max_ndim: int = 8
    max_tensor_bytes: int = 1 << 38  # a header cannot make a receiver allocate more per tensor
    max_chunks: int = 1 << 16  # per version
    max_tokens: int = 1 << 20  # per trajectory


class RejectionLog:
    """Counts rejected messages by source and logs why: the first `burst` of each
    source per `window` seconds get a line each with the reason; past that they are
    counted and summed up in one line when the window closes, so a flood of bad frames
    cannot fill the disk, yet every rejection is counted and reported. Call `tick()`
    now and then (receive loops do) so that a summary is not held back."""

    def __init__(self, logger: logging.Logger, burst: int = 20, window: float = 10.0):
        self.log, self.burst, self.window = logger, burst, window
        self.counts: Counter[str] = Counter()  # source -> rejections, ever
        self._opened: dict[str, float] = {}
        self._logged: Counter[str] = Counter()
        self._held: Counter[str] = Counter()
        self._last_reason: dict[str, str] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __call__(self, source: str, reason: str) -> None:
        self.counts[source] += 1
        self._roll(source, time.monotonic())
        if self._logged[source] < self.burst:
            self._logged[source] += 1
            self.log.warning("rejected a %s: %s", source, reason)
        else:
            self._held[source] += 1
            self._last_reason[source] = reason

    def tick(self) -> None:
        now = time.monotonic()
        for source in list(self._opened):
            self._roll(source, now)

    def flush(self) -> None:
        for source in list(self._opened):
            self._roll(source, float("inf"))

    def _roll(self, source: str, now: float) -> None:
        opened = self._opened.setdefault(source, now)
        if now - opened < self.window:
            return
        if self._held[source]:
            self.log.warning(
                "rejected %d more: %s (within %.0f s, not logged one by one; the last: %s)",
                self._held[source],
                source,
                self.window,
                self._last_reason[source],
            )
        del self._opened[source]
        self._logged[source] = self._held[source] = 0
