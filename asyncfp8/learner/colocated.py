"""The colocated placement (`run.placement=colocated`): the learner and its rollout engine
in one process, sharing its device.

Nothing but the transport changes. Work is leased from the same lease book and its
trajectories go through the same inbox (`Inbox.lease` / `Inbox.deliver`, no socket), so
the version numbers, leases, ledger, corrections and the chaos audit are the placement's
too. A version is quantized by the precision policy from the gathered weights, as for a
worker, and handed to the engine as tensors (`EngineVersions`: no encoding, no socket;
the refit probe is checked as a worker checks it).

Two ways to share it, by `run.mode`:
- `sync`, turns: when a step needs groups the learner generates them (one lease of all
  that are missing), then trains, then applies the new version. Nothing it trains on is
  stale.
- `async`, overlapped: a rollout thread leases and generates the next step's groups with
  the version the engine holds while the learner trains the current one, as a worker
  would (`run.max_staleness` bounds how old they may be, and the lease book's capacity
  how far ahead it runs). The learner gathers, calibrates and snapshots a new version's
  weights; the rollout thread makes it (the refit probe's reference, the policy's quantization),
  applies and checks it between two generate calls (`RolloutThreadJobs`), so only that
  thread touches the engine and none of it is on the learner's step. The torch threads
  are split between the two.
Today: one learner rank, the built-in torch engine.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

import torch
from omegaconf import DictConfig

from asyncfp8.engines import RolloutEngine
from asyncfp8.inbox import Inbox
from asyncfp8.refit import Probe, RefitChecker
from asyncfp8.rollout import ROLLOUT_STATS, roll_out
from asyncfp8.sync.version_pubsub import PublishStats
from asyncfp8.tasks import Task

log = logging.getLogger("asyncfp8.learner")
WORKER_ID = "colocated"  # how the books and the metrics name the learner's own engine


class RefitFailed(RuntimeError):
    """The engine does not compute what the version it was handed says (no transport to
    blame here: its modules or kernels disagree with the policy's reference)."""


class EngineVersions:
    """The colocated version channel: `publish` (as `sync.VersionPublisher.publish`
    takes it, from `sync.BackgroundPublisher`) applies each version to the engine in
    this process and checks its refit probe. It runs on the thread that generates (the
    learner's in turns, the rollout thread's when overlapped), so never during a
    generate call."""

    def __init__(
        self,
        engine: RolloutEngine,
        checker: RefitChecker | None,
        stats: dict,
    ):
        self.engine, self.checker, self.stats = engine, checker, stats
        self.in_flight = threading.Event()
        self.in_flight.set()
        self.rejected = 0  # no messages to reject

    def publish(
        self,
        version: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        extra: Mapping[str, torch.Tensor] | None = None,
        policy: str = "",
        engine_config: Mapping[str, Any] | None = None,
        roles: Mapping[str, Any] | None = None,
    ) -> PublishStats:
        started = time.perf_counter()
        tensors = dict(weights)  # the policy quantizes them as they stream, filling `roles`
        probe, sent = Probe.take(dict(extra or {}), roles)
        self.engine.update_weights(version, tensors, sent, roles)
        applied = time.perf_counter()
        self.stats["update_s"] += applied - started
        self.stats["updates"] += 1
        if probe is not None and self.checker is not None:
            check = self.checker.check(version, probe, sent)
            self.stats |= check.metrics()
            self.stats["refit/probe_s"] += self.checker.last_seconds
            self.stats["refit/probes"] += 1
            if not check.passed:
                self.stats["refit/failures"] += 1
                raise RefitFailed(check.describe())
        return PublishStats(version, 0, 0, time.perf_counter() - started)

    def close(self) -> None:
        pass


class RolloutThreadJobs(Executor):
    """Work the learner hands its rollout thread (overlapped): each version's publish,
    which the thread runs before its next lease and generate call (`run_pending`). A
    version is submitted before the lease book learns its number, so a lease that asks
    for it finds it here. A job that raises stops the thread (it cannot generate what
    the learner expects); once the thread has ended, new jobs run on the caller's thread,
    or are refused naming the thread's error."""

    def __init__(self):
        #: called after a job is queued: the rollout thread may be waiting on the lease book
        self.wake: Callable[[], None] = lambda: None
        self._jobs: deque[tuple[Future, Callable, tuple, dict]] = deque()
        self._lock = threading.Lock()
        self._ended = False
        self._error: BaseException | None = None

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                raise RuntimeError(
                    f"the colocated rollout thread failed: {self._error!r}"
                ) from self._error
            queued = not self._ended
            if queued:
                self._jobs.append((future, fn, args, kwargs))
        if queued:
            self.wake()
        else:
            self._run(future, fn, args, kwargs, raise_error=False)
        return future

    def run_pending(self) -> None:
        """On the rollout thread: runs the jobs submitted so far, in order."""
        while job := self._next(end=False):
            self._run(*job, raise_error=True)

    def end(self, error: BaseException | None, drain: bool = True) -> None:
        """On the rollout thread as it ends: runs what is pending (or, after `error`,
        fails it with that error; with `drain` false, cancels it: a stopped run has no use
        for a version made now); from now on `submit` does not queue."""
        if error is None and drain:
            while job := self._next(end=True):
                self._run(*job, raise_error=False)
            return
        with self._lock:
            self._ended, self._error = True, error
            pending, self._jobs = list(self._jobs), deque()
        for future, *_ in pending:
            if error is None:
                future.cancel()
            # releases a wait() on a cancelled future; False for it, True for the others
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _next(self, end: bool) -> tuple | None:
        with self._lock:
            if self._jobs:
                return self._jobs.popleft()
            self._ended = self._ended or end  # atomically with finding the queue empty
            return None

    @staticmethod
    def _run(future: Future, fn: Callable, args: tuple, kwargs: dict, raise_error: bool) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:
            future.set_exception(err)
            if raise_error:
                raise
            return
        future.set_result(result)


class Colocated:
    """The learner's own engine (rank 0): its rollout turns (`run.mode=sync`) or its
    rollout thread (`run.mode=async`), see the module's docstring."""

    def __init__(self, cfg: DictConfig, engine: RolloutEngine, task: Task, policy):
        self.cfg, self.engine, self.task = cfg, engine, task
        self.overlap = cfg.run.mode == "async"
        self.stats = dict.fromkeys(ROLLOUT_STATS, 0.0)
        checker = RefitChecker.for_worker(cfg.sync.get("probe"), engine, policy)
        self.versions = EngineVersions(engine, checker, self.stats)
        # Named and numbered as a worker's trajectories are on receipt: this process's
        # incarnation (a resumed learner is another sender) and a sequence number, which
        # the ledger records and the audit counts.
        self.sender = f"{WORKER_ID}/{uuid.uuid4().hex[:12]}"
        self.seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        #: overlapped: the versions to make and apply on the rollout thread (None: in turns,
        #: the learner's thread publishes them)
        self.jobs = RolloutThreadJobs() if self.overlap else None

    def start(self, inbox: Inbox) -> None:
        """Overlapped: starts the rollout thread (it leases once the first version is out)."""
        if self.overlap:
            self.jobs.wake = inbox.wake
            self._thread = threading.Thread(
                target=self._rollouts, args=(inbox,), name="asyncfp8-rollout", daemon=True
            )
            self._thread.start()

    def fill(self, inbox: Inbox, groups: int) -> None:
        """In turns: generates until the inbox holds `groups` complete groups, one lease of
        all that are missing (one generate call, the largest batch: on the 2-core dev VM
        68.5 trained samples/s against 57.5 with leases of run.lease_groups=4 of 8 groups),
        again only if dynamic sampling skipped some. Overlapped: the rollout thread fills
        it; this raises what stopped that thread, if anything did."""
        if self.overlap:
            if self.error is not None:
                raise RuntimeError(f"the colocated rollout thread failed: {self.error!r}") from (
                    self.error
                )
            return
        while (missing := groups - inbox.ready_groups()) > 0:
            lease = inbox.lease(WORKER_ID, missing, self.stats)
            if "lease" not in lease:
                raise RuntimeError(
                    f"the lease book gave the colocated engine no work ({lease}) with "
                    f"{inbox.ready_groups()} of {groups} groups ready"
                )
            self._generate(inbox, lease)

    def _rollouts(self, inbox: Inbox) -> None:
        """The rollout thread: lease a step's groups, generate, deliver; as a worker does,
        it waits while the lease book is full (the learner is a step behind) and stops
        when the run is over."""
        want = self.cfg.run.groups_per_step
        try:
            while not self._stop.is_set():
                self.jobs.run_pending()
                started = time.perf_counter()
                lease = inbox.lease_or_wait(WORKER_ID, want, self.stats)
                if lease.get("done"):
                    return
                if "wait" in lease:
                    self.stats["paused_s"] += time.perf_counter() - started
                    continue
                self.jobs.run_pending()  # the version this lease asks for, if just submitted
                self._generate(inbox, lease)
        except BaseException as err:  # the learner raises it at its next wait (fill)
            self.error = err
            log.exception("the colocated rollout thread failed")
            inbox.wake()  # a learner waiting for groups sees it now
        finally:
            # Stopped (preempted, or the learner failed): a pending version is cancelled
            # rather than made within the grace period. At the end of a run the learner
            # has waited for its last version already (Hub.finish).
            self.jobs.end(self.error, drain=not self._stop.is_set())

    def _generate(self, inbox: Inbox, lease: dict[str, Any]) -> None:
        if self.engine.version is None or self.engine.version < lease["min_version"]:
            raise RuntimeError(
                f"lease {lease['lease']} wants version {lease['min_version']}, the engine "
                f"holds {self.engine.version}"
            )
        started = time.perf_counter()
        trajectories = roll_out(self.engine, self.task, lease)
        self.stats["generate_s"] += time.perf_counter() - started
        self.stats["samples"] += len(trajectories)
        self.stats["tokens"] += sum(len(t.token_ids) for t in trajectories)
        for trajectory in trajectories:
            trajectory.worker_id, trajectory.sender, trajectory.seq = (
                WORKER_ID,
                self.sender,
                self.seq,
            )
            self.seq += 1
        inbox.deliver(trajectories)

    def stop(self, timeout: float | None = None) -> None:
        """Stops the rollout thread after its current generate call."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        self.engine.close()
