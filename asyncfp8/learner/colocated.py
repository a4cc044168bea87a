"""The colocated placement (`run.placement=colocated`): the learner and its rollout engine in
one process, sharing its device, with the separate placement's leases, inbox, versions and
refit probe (no socket). In turns (`run.mode=sync`) it generates, then trains; overlapped
(`async`) a rollout thread generates beside the training one and alone touches the engine.
How and why: docs/running.md#one-process-the-colocated-placement."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from asyncfp8.engines import RolloutEngine
from asyncfp8.engines.base import MemoryRelease
from asyncfp8.learner.inbox import Inbox
from asyncfp8.refit.probe import Probe, RefitChecker
from asyncfp8.run import distributed
from asyncfp8.sync.version_publisher import PublishStats
from asyncfp8.tasks import Task
from asyncfp8.worker.rollout import ROLLOUT_STATS, roll_out, split_lease

log = logging.getLogger("asyncfp8.learner")
WORKER_ID = "colocated"  # how the books and the metrics name the learner's own engine
# vLLM's share of the GPU beside the learner (engine.gpu_memory_utilization=null): TRL's
# colocate default; vLLM's own 0.9 would leave the learner a tenth of the device.
COLOCATED_VLLM_MEMORY = 0.3


@contextlib.contextmanager
def kept_random_state():
    """The process's random generators (Python's, NumPy's, torch's CPU and CUDA ones) as
    they were before: an engine started in the learner's process may seed them (vLLM
    seeds them all with engine.seed), and the learner's draws follow run.seed."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


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
    """Work the learner hands its rollout thread (overlapped): each version's publish, run
    before the thread's next lease (`run_pending`; other ranks up to the version rank 0
    names, `run_until`). Submitted before the lease book learns the number, so a lease that
    asks for it finds it. A job that raises stops the thread; later jobs then run on the
    caller's thread, or are refused naming the thread's error."""

    def __init__(self):
        #: called after a job is queued: the rollout thread may be waiting on the lease book
        self.wake: Callable[[], None] = lambda: None
        self._jobs: deque[tuple[Future, Callable, tuple, dict]] = deque()
        self._lock = threading.Condition()
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
                self._lock.notify_all()
        if queued:
            self.wake()
        else:
            self._run(future, fn, args, kwargs, raise_error=False)
        return future

    def run_pending(self) -> None:
        """On the rollout thread: runs the jobs submitted so far, in order."""
        while job := self._next(end=False):
            self._run(*job, raise_error=True)

    def run_until(self, reached: Callable[[], bool], timeout: float) -> None:
        """On the rollout thread: runs jobs in order, one at a time, until `reached()`
        (before each), waiting up to `timeout` seconds for the next to be submitted (a
        follower rank's rollout thread, told by rank 0 which version to generate with,
        before its own learner thread has handed that version over)."""
        deadline = time.monotonic() + timeout
        while not reached():
            with self._lock:
                while not self._jobs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no version job came within {timeout:.0f} s")
                    self._lock.wait(left)
            if job := self._next(end=False):
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


class RolloutFailed(RuntimeError):
    """The colocated rollouts cannot go on: rank 0's rollout thread, or a rank's engine,
    failed (the message names which and why)."""


# What rank 0 tells the other ranks' engines (several ranks colocated): generate a part of
# a lease with a version, the rollouts are over, or they stopped (preempted or failed).
LEASE, DONE, STOPPED = "lease", "done", "stopped"


class Colocated:
    """A learner rank's own engine: its rollout turns (`run.mode=sync`) or its rollout
    thread (`async`). With several ranks, rank 0 holds the books and splits each lease over
    the ranks' engines (`split_lease` keeps each sample's stream, so the tokens are one
    engine's); the others follow (`follow`), in turns on the learner's group, overlapped
    on the rollout threads' own `group`."""

    def __init__(
        self,
        cfg: DictConfig,
        engine: RolloutEngine,
        task: Task,
        policy,
        rank: int = 0,
        world: int = 1,
        group: Any = None,
        release_memory: bool = False,
    ):
        self.cfg, self.engine, self.task = cfg, engine, task
        self.rank, self.world, self.group = rank, world, group
        self.overlap = cfg.run.mode == "async"
        if release_memory and not isinstance(engine, MemoryRelease):
            raise ValueError(
                f"run.release_engine_memory=true: engine {engine.name} cannot release its "
                "memory (it has no release_memory); set run.release_engine_memory=false"
            )
        #: in turns, the engine's memory is given back after each turn (MemoryRelease)
        self.release_memory = release_memory
        self.stats = dict.fromkeys(ROLLOUT_STATS, 0.0)
        self.stats |= {"memory/releases": 0.0, "memory/released_gib": 0.0}
        checker = RefitChecker.for_worker(cfg.sync.probe, engine, policy)
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

    def start(self, inbox: Inbox | None) -> None:
        """Overlapped: starts the rollout thread (rank 0's leases once the first version
        is out; the other ranks' follow rank 0's)."""
        if not self.overlap:
            return
        if inbox is not None:
            self.jobs.wake = inbox.wake
            target, args = self._rollouts, (inbox,)
        else:
            target, args = self._follow_rollouts, ()
        self._thread = threading.Thread(
            target=target, args=args, name="asyncfp8-rollout", daemon=True
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
                raise RolloutFailed(f"the colocated rollout thread failed: {self.error!r}") from (
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
        self._release()

    def _release(self) -> None:
        """In turns, after a turn: the learner trains next, and the device is its own."""
        if self.release_memory:
            freed = self.engine.release_memory()
            self.stats["memory/releases"] += 1
            self.stats["memory/released_gib"] = freed / 2**30

    def _rollouts(self, inbox: Inbox) -> None:
        """Rank 0's rollout thread: lease a step's groups, generate, deliver; as a worker
        does, it waits while the lease book is full (the learner is a step behind) and
        stops when the run is over."""
        want = self.cfg.run.groups_per_step
        end = DONE
        try:
            self._on_the_engines_device()
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
            end = STOPPED
        except BaseException as err:  # the learner raises it at its next wait (fill)
            self.error, end = err, STOPPED
            log.exception("the colocated rollout thread failed")
            inbox.wake()  # a learner waiting for groups sees it now
        finally:
            # Stopped (preempted, or the learner failed): a pending version is cancelled
            # rather than made within the grace period. At the end of a run the learner
            # has waited for its last version already (Hub.finish). Settled before the
            # other ranks are told, which waits on them.
            self.jobs.end(self.error, drain=not self._stop.is_set())
            self._tell_the_others(end)

    def _on_the_engines_device(self) -> None:
        """A new thread starts on CUDA device 0: the rollout thread works on its engine's
        (each rank's own GPU), where its kernels launch and its CUDA graphs capture."""
        device = getattr(self.engine, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            torch.cuda.set_device(device)

    def _tell_the_others(self, end: str) -> None:
        """Rank 0's rollout thread ends: the other ranks' threads end too."""
        if self.world == 1:
            return
        try:
            distributed.scatter([(end,)] * self.world, self.group)
        except Exception:  # a rank already gone (its own failure ends the run)
            log.exception("could not tell the other ranks' rollout threads to end")

    def _generate(self, inbox: Inbox, lease: dict[str, Any]) -> None:
        if self.engine.version is None or self.engine.version < lease["min_version"]:
            raise RuntimeError(
                f"lease {lease['lease']} wants version {lease['min_version']}, the engine "
                f"holds {self.engine.version}"
            )
        started = time.perf_counter()
        if self.world == 1:
            trajectories = roll_out(self.engine, self.task, lease)
        else:
            trajectories = self._generate_on_every_rank(lease)
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

    def _generate_on_every_rank(self, lease: dict[str, Any]) -> list:
        """Rank 0: the lease split over the ranks, each part generated by its rank's engine
        with the version rank 0's holds; the trajectories in the lease's order."""
        parts = split_lease(lease, self.world)
        distributed.scatter([(LEASE, part, self.engine.version) for part in parts], self.group)
        mine: list = []
        failure = None
        try:
            mine = roll_out(self.engine, self.task, parts[0])
        except Exception as err:  # the others still answer this round
            failure = f"learner rank 0's engine failed: {err!r}"
            log.exception("learner rank 0's engine failed")
        answers = distributed.gather(None, self.group)
        trajectories = list(mine)
        for rank, answer in enumerate(answers[1:], start=1):
            status, payload = answer
            if status != "ok":
                failure = failure or f"learner rank {rank}'s engine failed: {payload}"
            else:
                trajectories.extend(payload)
        if failure is not None:
            raise RolloutFailed(failure)
        return trajectories

    def follow(self, message: tuple) -> bool:
        """A rank other than 0: carries out one of rank 0's messages (generates its part
        of a lease and answers with the trajectories, or with what failed); False when
        the rollouts are over."""
        if message[0] != LEASE:
            return False
        _, part, version = message
        try:
            self._hold(version)
            started = time.perf_counter()
            trajectories = roll_out(self.engine, self.task, part) if part["prompts"] else []
            self.stats["generate_s"] += time.perf_counter() - started
            self.stats["samples"] += len(trajectories)
            self.stats["tokens"] += sum(len(t.token_ids) for t in trajectories)
            self._release()
            answer: tuple = ("ok", trajectories)
        except Exception as err:  # rank 0 stops the run, naming it
            log.exception("this rank's colocated engine failed")
            self.error = err
            answer = ("error", repr(err))
        distributed.gather(answer, self.group)
        return True

    def _hold(self, version: int) -> None:
        """This rank's engine on `version`, the one rank 0 generates with: in turns its
        learner thread applied it already; overlapped, the version jobs up to it are run
        (waiting for the learner thread to submit it, within run.dist_timeout)."""
        if self.jobs is not None:

            def reached() -> bool:
                return self.engine.version is not None and self.engine.version >= version

            self.jobs.run_until(reached, self.cfg.run.dist_timeout)
        if self.engine.version != version:
            raise RuntimeError(
                f"rank 0 generates with version {version}, this rank's engine holds "
                f"{self.engine.version}"
            )

    def _follow_rollouts(self) -> None:
        """A rank other than 0, overlapped: its rollout thread follows rank 0's."""
        end = STOPPED
        try:
            self._on_the_engines_device()
            while True:
                message = distributed.scatter(None, self.group)
                if not self.follow(message):
                    end = message[0]
                    return
        except BaseException as err:
            self.error = err
            log.exception("the colocated rollout thread failed")
        finally:
            self.jobs.end(self.error, drain=end == DONE)

    def summary(self) -> str:
        """What this rank's engine did (the other ranks log it at the end)."""
        stats = self.stats
        return (
            f"learner rank {self.rank}'s engine generated {stats['samples']:.0f} samples "
            f"({stats['tokens']:.0f} tokens) in {stats['generate_s']:.1f} s; applied "
            f"{stats['updates']:.0f} versions, {stats['refit/probes']:.0f} refit probes "
            f"checked, {stats['refit/failures']:.0f} failed"
        )

    def stop(self, timeout: float | None = None) -> None:
        """Stops the rollout thread after its current generate call, waiting for it at
        most `timeout` seconds (None: until it has). On the other ranks it ends when rank
        0's tells it to, which rank 0 does as its own ends (at the end of a run, after
        its last checkpoint and export; a rank 0 that dies takes the group down)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        self.engine.close()
