"""Rank 0's side of the learner: the sockets (versions out, trajectories and lease requests in
on the inbox's thread), the lease book, the ledger, the metrics log, and the hand-out of
every rank's share of a step (or STOP). Colocated it has no sockets: the learner's own
engine fills the inbox. `RankHub`, on the other ranks, only receives its share, so the
learner's loop reads the same on every rank."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from omegaconf import DictConfig

from asyncfp8.learner.inbox import Inbox
from asyncfp8.learner.leases import LeaseBook
from asyncfp8.learner.ledger import Ledger
from asyncfp8.report.metrics import MetricsLog
from asyncfp8.run import distributed
from asyncfp8.run.process import StopFlag
from asyncfp8.run.resume import save_config
from asyncfp8.sync import BackgroundPublisher, HandshakeWatch, Limits, VersionPublisher
from asyncfp8.sync.endpoints import curve, endpoints
from asyncfp8.train.batches import Group
from asyncfp8.train.step import Share, all_rewards_equal
from asyncfp8.train.step_metrics import StepMetrics
from asyncfp8.train.sums import StepSums

from .colocated import LEASE, Colocated, RolloutFailed

log = logging.getLogger("asyncfp8.learner")
STOP = "stop"  # what rank 0 hands the others instead of a share when the run stops
WAIT_LOG_S = 5.0  # how often a learner waiting for trajectories says so
COLOCATED_WAIT_S = 0.5  # how often it checks on its own rollout thread (colocated, async)


class Preempted(Exception):
    """SIGTERM / Ctrl-C while waiting for data."""


class Hub:
    """Rank 0's sockets, books and logs (see the module's docstring)."""

    sender: BackgroundPublisher

    def __init__(
        self,
        cfg: DictConfig,
        max_staleness: int,
        world: int,
        stop: StopFlag,
        step_metrics: StepMetrics,
        colocated: Colocated | None = None,
    ):
        run, sync = cfg.run, cfg.sync
        self.colocated = colocated
        self.cfg, self.max_staleness, self.world, self.stop = cfg, max_staleness, world, stop
        self.step_metrics = step_metrics
        addresses, secure = endpoints(sync, "bind"), curve(sync)
        self.watch = HandshakeWatch()
        book = LeaseBook(
            capacity=(max_staleness + 1) * run.groups_per_step * sync.every,
            timeout=run.lease_timeout,
        )
        sampling = {
            "n": run.group_size,
            "temperature": run.temperature,
            "max_new_tokens": run.max_new_tokens,
        }
        if colocated is not None:
            self.versions = colocated.versions
            # in turns on the learner's thread; overlapped on the rollout thread (`jobs`)
            self.sender = BackgroundPublisher(
                self.versions, background=False, executor=colocated.jobs
            )
            self.inbox = Inbox(None, book, run.group_size, sampling, run.seed, None)
            self.ledger: Ledger | None = None
            self.metrics: MetricsLog | None = None
            return
        try:
            self.versions = VersionPublisher(
                addresses.versions,
                addresses.snapshots,
                chunk_bytes=max(1, int(sync.chunk_mb * (1 << 20))),
                curve=secure,
                watch=self.watch,
                transport=sync.transport,
                zstd_level=sync.zstd_level,
            )
            self.sender = BackgroundPublisher(self.versions, background=sync.background)
            self.inbox = Inbox(
                addresses.trajectories,
                book,
                run.group_size,
                sampling,
                run.seed,
                secure,
                limits=Limits(max_message_bytes=int(sync.max_trajectory_mb * (1 << 20))),
                watch=self.watch,
            )
        except zmq.ZMQError as err:
            raise SystemExit(
                f"learner: cannot listen on {addresses}: {err}. Is another learner running? "
                "Pick other ports with sync.version_port=... sync.snapshot_port=... "
                "sync.trajectory_port=..."
            ) from None
        self.ledger: Ledger | None = None
        self.metrics: MetricsLog | None = None

    def open_logs(self, run_dir: Path, resumed_step: int | None) -> None:
        """The ledger and the metrics log (trimmed back to `resumed_step` on a resume),
        and the run's config beside them."""
        self.ledger = Ledger(run_dir, resumed_step=resumed_step)
        # run.loggers: JSONL, TensorBoard, W&B (a resumed run continues its W&B run)
        self.metrics = MetricsLog.for_run(self.cfg, resumed_step=resumed_step)
        save_config(self.cfg, run_dir)

    def start(self) -> None:
        self.inbox.start()
        if self.colocated is not None:
            self.colocated.start(self.inbox)

    def say(self, message: str, *args: Any) -> None:
        """Logs `message` once for the run (rank 0 speaks for every rank)."""
        log.info(message, *args)

    def published(self, sync_metrics: dict) -> None:
        """The first version is out: work for it may be leased."""
        self.inbox.trained(0, sync_metrics["sync/version"])

    # -- a step's data -------------------------------------------------------------------

    def next_share(
        self, step: int, version: int, plan: Callable[[list[Group]], list[Share]]
    ) -> tuple[Share, list[Group], float]:
        """Waits for the step's groups and hands every rank its share of `plan(groups)`;
        hands them STOP instead when the run stops. (rank 0's share, the groups, seconds
        waited)."""
        waited = time.perf_counter()
        try:
            if self.stop:
                raise Preempted
            groups = self._wait_for_groups(step, version)
        except Preempted:
            distributed.scatter([(STOP, self.stop.signal or 15)] * self.world)
            raise
        except (SystemExit, Exception):  # a failed rollout, or anything: the others stop too
            with contextlib.suppress(Exception):  # unless the group itself is what failed
                distributed.scatter([(STOP, None)] * self.world)
            raise
        share = distributed.scatter(plan(groups))
        return share, groups, time.perf_counter() - waited

    def _wait_for_groups(self, step: int, version: int) -> list[Group]:
        run = self.cfg.run
        skip = all_rewards_equal if run.dynamic_sampling else None
        waited_since = time.monotonic()
        turns = self.colocated is not None and not self.colocated.overlap
        while True:
            if self.colocated is not None:  # the learner's own rollout turn, or its thread's health
                self.colocated.fill(self.inbox, run.groups_per_step)
            wait = 0.0 if turns else COLOCATED_WAIT_S if self.colocated is not None else WAIT_LOG_S
            groups = self.inbox.take(
                run.groups_per_step, version, self.max_staleness, wait, skip=skip
            )
            if groups is not None:
                return groups
            if self.stop:
                raise Preempted
            waited = time.monotonic() - waited_since
            if self.colocated is not None:  # generating, or dynamic sampling skipped some
                if waited > run.worker_wait_timeout:
                    why = (
                        "run.dynamic_sampling skips every group whose rewards are all equal"
                        if run.dynamic_sampling
                        else "is the engine this slow? (stats: "
                        f"{self.inbox.snapshot_counts()['workers']})"
                    )
                    raise SystemExit(
                        f"learner: no {run.groups_per_step} groups"
                        f"{' with a reward spread' if run.dynamic_sampling else ''} after "
                        f"{waited:.0f} s of generating in this process "
                        f"(run.worker_wait_timeout): {why}"
                    )
                continue
            counts = self.inbox.snapshot_counts()
            if waited > run.worker_wait_timeout:
                raise SystemExit(
                    f"learner: no {run.groups_per_step} groups after {waited:.0f} s "
                    f"(run.worker_wait_timeout); workers heard from: "
                    f"{sorted(counts['workers']) or 'none'}. Are workers running and "
                    f"connecting to {endpoints(self.cfg.sync, 'connect').trajectories}?"
                )
            log.info(
                "step %d: waiting for trajectories (%.0f s; %d groups ready, %d open; workers %s)",
                step,
                waited,
                counts["queue/ready_groups"],
                counts["queue/open_groups"],
                sorted(counts["workers"]) or "none yet",
            )

    # -- after a step --------------------------------------------------------------------

    def trained(
        self, step: int, version: int, groups: list[Group], sums: StepSums, lr: float, kl: bool
    ) -> dict[str, Any]:
        """Books the step in the ledger; its metrics."""
        skipped = self.inbox.take_skipped()
        self.ledger.write(step, version, groups, self.inbox.take_dropped(), skipped)
        metrics = self.step_metrics.of_step(groups, sums, version, lr, kl)
        return metrics | {"groups/skipped": len(skipped)}

    def record(
        self, step: int, metrics: dict[str, Any], groups: int, published: dict, times: dict
    ) -> None:
        """Tells the inbox what was trained and published, adds the rollout side's
        metrics since the previous step and the clock's (`times`), and writes them."""
        self.inbox.trained(groups, published.get("sync/version"))
        counts = self.inbox.snapshot_counts()
        metrics |= self.step_metrics.throughput(counts, times["time/step_total_s"])
        metrics["total/rejected/snapshot_request"] = self.versions.rejected
        metrics["total/failed_handshakes"] = self.watch.failures
        self.metrics.write(step, metrics | times)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if metrics:
            self.metrics.write(step, metrics)

    # -- state, end ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return self.inbox.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inbox.load_state_dict(state)
        if self.colocated is not None:
            # The leases the stopped process's rollout thread held: nobody will return them.
            expired = self.inbox.expire_all()
            if expired:
                log.info(
                    "expired %d lease(s) the stopped process was generating: prompts %s go "
                    "back to the front of the queue",
                    len(expired),
                    sorted(p for lease in expired for p in lease.pending),
                )

    def abort(self) -> None:
        """The learner failed: its own rollout thread stops too (at most one generate call
        later), rather than generating until the interpreter exits."""
        if self.colocated is not None:
            self.colocated.stop(timeout=60)

    def finish(self) -> None:
        """Waits for the last version to be out (its failure fails the run, as any
        version's does), then tells the workers the run is done and gives them a moment
        to hear it."""
        self.sender.wait()
        self.inbox.finish(linger=0 if self.colocated is not None else 15)

    def close(self) -> None:
        self.inbox.close()
        self.versions.close()
        if self.colocated is not None:
            self.colocated.close()
        self.watch.close()
        if self.ledger is not None:
            self.ledger.close()
        if self.metrics is not None:
            self.metrics.close()


class RankHub:
    """The other ranks' hub: their share of each step from rank 0, and nothing else; in a
    colocated run also their engine's part of each lease (`Colocated.follow`)."""

    def __init__(self, stop: StopFlag, colocated: Colocated | None = None):
        self.stop, self.colocated = stop, colocated
        self.sender: BackgroundPublisher | None = None
        if colocated is not None:  # each version to this rank's own engine, as on rank 0
            self.sender = BackgroundPublisher(
                colocated.versions, background=False, executor=colocated.jobs
            )

    def open_logs(self, run_dir: Path, resumed_step: int | None) -> None:
        pass

    def start(self) -> None:
        if self.colocated is not None:
            self.colocated.start(None)

    def say(self, message: str, *args: Any) -> None:
        pass

    def published(self, sync_metrics: dict) -> None:
        pass

    def next_share(self, step: int, version: int, plan) -> tuple[Share, None, float]:
        waited = time.perf_counter()
        share = distributed.scatter(None)
        # Colocated in turns: rank 0's rollout turn comes first, its leases split over us.
        while isinstance(share, tuple) and share[0] == LEASE:
            self.colocated.follow(share)
            share = distributed.scatter(None)
        if isinstance(share, tuple) and share[0] == STOP:
            if share[1] is None:
                raise SystemExit(1)  # rank 0 failed and said why in its log
            self.stop.signal = share[1]
            raise Preempted
        return share, None, time.perf_counter() - waited

    def trained(self, step, version, groups, sums, lr, kl) -> dict[str, Any]:
        return {}

    def record(self, step, metrics, groups, published, times) -> None:
        pass

    def write(self, step, metrics) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state) -> None:
        pass

    def abort(self) -> None:
        if self.colocated is not None:
            self.colocated.stop(timeout=60)

    def finish(self) -> None:
        """Colocated: waits for the rollout thread to end (rank 0's says the run is done
        after its last checkpoint and export) and for this rank's versions to settle."""
        if self.colocated is not None:
            self.colocated.stop()
            if self.colocated.error is not None:
                raise RolloutFailed(f"this rank's engine failed: {self.colocated.error!r}")
            self.sender.wait()
            log.info(self.colocated.summary())

    def close(self) -> None:
        if self.colocated is not None:
            self.colocated.close()
