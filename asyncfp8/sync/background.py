"""Publishing off the learner's critical path (docs/sync.md, 'Publishing off the critical path').

`submit` copies the weights into buffers of this object and returns; a thread quantizes,
encodes and sends that snapshot while the learner trains the next step, so version N is
made from exactly step N's weights. With an `executor` (a colocated learner) it runs there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for_futures
from typing import Any

import torch

from ..precision.manifest import TensorRole
from .version_publisher import PublishStats, VersionPublisher

log = logging.getLogger("asyncfp8.sync")
Quantize = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]]
#: More extra tensors made from the snapshot and the caller's extra (the refit probe)
Annotate = Callable[
    [list[tuple[str, torch.Tensor]], Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]
]


class PublishFailed(RuntimeError):
    """A background publish raised; the next `submit` or `wait` re-raises it."""


class BackgroundPublisher:
    """Publishes through `publisher` on a thread of its own (`background`), on
    `executor`'s thread when one is given, or (neither) on the caller's."""

    def __init__(
        self,
        publisher: VersionPublisher,
        background: bool = True,
        executor: Executor | None = None,
    ):
        self.publisher, self.background, self.executor = publisher, background, executor
        self.last: PublishStats | None = None  # the latest publish that finished
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._future: Future | None = None
        self._future_version: int | None = None
        self._error: BaseException | None = None
        self._failed_version: int | None = None
        self.annotate_s = 0.0  # the latest publish's annotate() time

    def submit(
        self,
        version: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        quantize: Quantize,
        extra: Mapping[str, torch.Tensor] | None = None,
        policy: str = "",
        engine_config: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        annotate: Annotate | None = None,
        roles: Mapping[str, TensorRole] | None = None,
    ) -> float:
        """Snapshots `weights` (as `dtype`; None: as they are) and publishes
        `quantize(snapshot)` plus `extra` (and `annotate(snapshot, extra)`) as version
        `version` in the background, each tensor with its role in `roles` (which `quantize`
        may fill as it streams); returns the seconds spent waiting for the previous publish."""
        waited = self.wait()
        snapshot = self._snapshot(weights, dtype)
        job = (
            version,
            snapshot,
            quantize,
            dict(extra or {}),
            policy,
            dict(engine_config or {}),
            annotate,
            roles,
        )
        if self.executor is not None:
            self.publisher.in_flight.clear()
            # raise_error: the executor's thread must not go on as if the version were out
            self._future = self.executor.submit(self._run, *job, raise_error=True)
            self._future_version = version
            return waited
        if not self.background:
            self._run(*job)
            self._raise()
            return waited
        self.publisher.in_flight.clear()
        self._thread = threading.Thread(
            target=self._run, args=job, name="asyncfp8-publish", daemon=True
        )
        self._thread.start()
        return waited

    def wait(self) -> float:
        """Waits for the publish in flight (if any); the seconds waited. Re-raises its
        error as PublishFailed."""
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._future is not None:
            future, self._future = self._future, None
            wait_for_futures([future])
            # failed without running (the executor's thread had failed first); a cancelled
            # one (the thread stopped) was never published, which only a stop does
            if self._error is None and not future.cancelled() and future.exception():
                self._error, self._failed_version = future.exception(), self._future_version
        self._raise()
        return time.perf_counter() - started

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise PublishFailed(f"publishing version {self._failed_version} failed") from error

    def _snapshot(
        self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> list[tuple[str, torch.Tensor]]:
        """The weights copied into buffers kept across versions (pinned when they come
        from a GPU, so the copy is a DMA and the next step may start at once)."""
        snapshot = []
        copying_from: set[torch.device] = set()  # GPUs whose copies may still be running
        with torch.no_grad():
            for name, tensor in weights:
                buffer = self._buffers.get(name)
                wanted = dtype or tensor.dtype
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != wanted:
                    buffer = torch.empty(tensor.shape, dtype=wanted, pin_memory=tensor.is_cuda)
                    self._buffers[name] = buffer
                buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                if tensor.is_cuda:
                    copying_from.add(tensor.device)
                snapshot.append((name, buffer))
        # The buffers are on the CPU: it is their sources that say a copy may be in flight.
        for device in copying_from:
            torch.cuda.synchronize(device)
        return snapshot

    def _run(
        self,
        version,
        snapshot,
        quantize,
        extra,
        policy,
        engine_config,
        annotate,
        roles,
        raise_error=False,
    ) -> None:
        try:
            with torch.no_grad():
                if annotate is not None:
                    started = time.perf_counter()
                    extra |= annotate(snapshot, extra)
                    self.annotate_s = time.perf_counter() - started
                self.last = self.publisher.publish(
                    version,
                    quantize(snapshot),
                    extra,
                    policy=policy,
                    engine_config=engine_config,
                    roles=roles,
                )
        except BaseException as err:  # re-raised on the learner's thread by the next call
            log.exception("publishing version %d failed", version)
            self._error, self._failed_version = err, version
            if raise_error:
                raise
        finally:
            self.publisher.in_flight.set()
