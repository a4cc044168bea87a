"""The learner's receiving side: trajectories in, complete GRPO groups out, and the answers to
the workers' lease requests, on a thread of its own so that trajectories are acknowledged and
work leased while the learner computes; it keeps the lease book (learner/leases.py) current.
A colocated learner has no socket and no thread: its engine calls `lease` and `deliver`
directly, through the same books."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from asyncfp8.learner.leases import LeaseBook
from asyncfp8.moe import MoELayout
from asyncfp8.moe.routes import routes_of
from asyncfp8.sync import HandshakeWatch, Limits, Trajectory, TrajectoryReceiver
from asyncfp8.train.batches import Group

log = logging.getLogger("asyncfp8.learner")


class Inbox:
    """The learner's receiving side, on its own thread: acknowledges trajectories,
    assembles them into groups, answers lease requests from the `LeaseBook`, and
    expires the leases of workers that died holding them."""

    def __init__(
        self,
        address: str | None,
        book: LeaseBook,
        group_size: int,
        sampling: dict,
        seed: int,
        curve,
        limits: Limits | None = None,
        watch: HandshakeWatch | None = None,
    ):
        self.book, self.group_size, self.sampling, self.seed = book, group_size, sampling, seed
        self.receiver = None
        if address is not None:
            self.receiver = TrajectoryReceiver(
                address, curve=curve, limits=limits, on_lease=self._on_lease, watch=watch
            )
        self.lock = threading.Condition()
        self.ready: deque[Group] = deque()
        self.dropped: list[tuple[int, int, int]] = []  # stale groups since the last step
        # Groups consumed without training (DAPO's dynamic sampling) since the last step:
        # the ledger records them with the next step, the checkpoint until then.
        self.skipped: list[Group] = []
        self.partial: dict[tuple[int, int], list[Trajectory]] = {}
        self.version: int | None = None  # the newest published version: leases start from it
        self.finished = False
        self.workers: dict[str, dict[str, float]] = {}  # worker id -> its latest counters
        self.told_done: set[str] = set()
        self.reported: set[tuple[int, int]] = set()  # groups already reported as not owed
        self.last_request: dict[str, float] = {}
        self.counts = dict.fromkeys(
            (
                "samples",
                "tokens",
                "stale_groups",
                "skipped_groups",
                "late_samples",
                "bad_trajectories",
                "waits",
            ),
            0,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="asyncfp8-inbox", daemon=True)
        #: told of each group as it becomes ready (the proximal thread scores it ahead)
        self.on_group: Callable[[Group], None] | None = None
        #: an MoE model's layout, which a sample's routes must fit (None: a dense model)
        self.route_layout: MoELayout | None = None

    def start(self) -> None:
        if self.receiver is not None:
            self._thread.start()

    def deliver(self, trajectories: list[Trajectory]) -> None:
        """Trajectories handed over in this process (no socket: each arrives once)."""
        with self.lock:
            for trajectory in trajectories:
                self._add(trajectory)

    def lease_or_wait(self, worker: str, want: int, stats: dict[str, float]) -> dict[str, Any]:
        """`lease`; when the answer is to wait, first waits that long or until the books
        change (a step frees capacity or publishes a version, a group completes, the run
        finishes), with no change missed between the answer and the wait: a colocated
        rollout thread asks here."""
        with self.lock:  # a Condition over an RLock: `lease` takes it again
            answer = self.lease(worker, want, stats)
            if "wait" in answer:
                self.lock.wait(float(answer["wait"]))
            return answer

    def wake(self) -> None:
        """Wakes whoever waits on the books (a learner waiting for groups)."""
        with self.lock:
            self.lock.notify_all()

    def expire_all(self) -> list:
        """Every outstanding lease expired now, its missing prompts queued first and its
        partial groups dropped: what a resumed colocated learner does with the leases its
        stopped rollout thread held (no other process holds them, and no socket thread
        expires them). Returns the expired leases."""
        with self.lock:
            expired = self.book.expire(math.inf)
            for lease in expired:
                for prompt in lease.pending:
                    self.partial.pop((lease.id, prompt), None)
            self.lock.notify_all()
            return expired

    def ready_groups(self) -> int:
        with self.lock:
            return len(self.ready)

    def lease(self, worker: str, want: int, stats: dict[str, float]) -> dict[str, Any]:
        """The answer to a lease request of `want` groups from `worker` in this process."""
        return self._on_lease({"worker_id": worker, "sender": worker, "want": want, "stats": stats})

    def _serve(self) -> None:
        last_expiry = time.monotonic()
        while not self._stop.is_set():
            trajectories = self.receiver.poll(timeout_ms=50)
            with self.lock:
                for trajectory in trajectories:
                    self._add(trajectory)
                if time.monotonic() - last_expiry > 1.0:
                    last_expiry = time.monotonic()
                    for lease in self.book.expire(time.monotonic()):
                        log.warning(
                            "lease %d of %s expired after %.0f s: prompts %s go to another worker",
                            lease.id,
                            lease.worker,
                            self.book.timeout,
                            sorted(lease.pending),
                        )
                        for prompt in lease.pending:
                            self.partial.pop((lease.id, prompt), None)

    def _add(self, trajectory: Trajectory) -> None:
        lease = trajectory.meta.get("lease")
        if not isinstance(lease, int) or not trajectory.token_ids:
            self.counts["bad_trajectories"] += 1
            log.warning(
                "dropped a trajectory from %s without a lease or tokens", trajectory.worker_id
            )
            return
        if trajectory.routes is not None and not self._routes_fit(trajectory, lease):
            return
        key = (lease, trajectory.prompt_index)
        owed = self.book.leases.get(lease)
        if owed is None or trajectory.prompt_index not in owed.pending:
            self.counts["late_samples"] += 1
            if key not in self.reported:  # once per group, not per sample
                self.reported.add(key)
                log.warning(
                    "dropping samples of (lease %d, prompt %d) from %s: not owed (the lease "
                    "expired, or an earlier learner granted it after its last checkpoint)",
                    lease,
                    trajectory.prompt_index,
                    trajectory.worker_id,
                )
            return
        part = self.partial.setdefault(key, [])
        part.append(trajectory)
        if len(part) < self.group_size:
            return
        del self.partial[key]
        self.book.returned(lease, trajectory.prompt_index)
        group = Group(lease, trajectory.prompt_index, part)
        self.ready.append(group)
        if self.on_group is not None:
            self.on_group(group)
        self.counts["samples"] += len(part)
        self.counts["tokens"] += sum(len(t.token_ids) for t in part)
        self.lock.notify_all()

    def _routes_fit(self, trajectory: Trajectory, lease: int) -> bool:
        """Whether a sample's routes fit its tokens and the model; one that does not is
        dropped (never trained on), counted and named."""
        sample = (
            f"sample {trajectory.seq} of {trajectory.worker_id} (lease {lease}, prompt "
            f"{trajectory.prompt_index})"
        )
        tokens = len(trajectory.prompt_ids) + len(trajectory.token_ids)
        try:
            if self.route_layout is None:
                raise ValueError(f"{sample}: routes sent for a dense model")
            routes_of(trajectory.routes, tokens, self.route_layout, sample)
        except ValueError as err:
            self.counts["bad_trajectories"] += 1
            log.warning("dropped a trajectory whose routes do not fit: %s", err)
            return False
        return True

    def _on_lease(self, request: dict[str, Any]) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            self.workers[request["worker_id"]] = request["stats"]
            self.last_request[request["sender"]] = now
            if self.finished:
                self.told_done.add(request["sender"])
                return {"done": True}
            if self.version is None:
                return {"wait": 0.5}
            lease = self.book.grant(request["sender"], request["want"], self.version, now)
            if lease is None:
                self.counts["waits"] += 1
                return {"wait": 0.2}
            return {
                "lease": lease.id,
                "prompts": lease.prompts,
                "min_version": lease.min_version,
                "sampling": self.sampling | {"seed": self.seed * 1_000_003 + lease.serial},
            }

    def take(
        self,
        count: int,
        version: int,
        max_staleness: int,
        timeout: float,
        skip: Callable[[Group], bool] | None = None,
    ) -> list[Group] | None:
        """`count` groups no older than `max_staleness` versions, oldest first; None if
        they did not arrive within `timeout` s. Stale groups met on the way are dropped
        (and their prompts queued again); groups `skip` rejects are consumed without
        training (their capacity frees at once, so more are leased)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                stale = [g for g in self.ready if version - g.oldest_version > max_staleness]
                for group in stale:
                    self.ready.remove(group)
                    self.book.dropped(group.prompt)
                    self.dropped.append((group.lease, group.prompt, group.oldest_version))
                    self.counts["stale_groups"] += 1
                    log.info(
                        "dropped the group of (lease %d, prompt %d) from %s: too stale (version "
                        "%d, training %d, max staleness %d); the prompt is queued again",
                        group.lease,
                        group.prompt,
                        group.trajectories[0].worker_id,
                        group.oldest_version,
                        version,
                        max_staleness,
                    )
                for group in [g for g in self.ready if skip is not None and skip(g)]:
                    self.ready.remove(group)
                    self.book.close(1)
                    self.skipped.append(group)
                    self.counts["skipped_groups"] += 1
                    self.lock.notify_all()  # capacity freed: a colocated rollout thread leases
                if len(self.ready) >= count:
                    return [self.ready.popleft() for _ in range(count)]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(min(left, 0.5))

    def take_dropped(self) -> list[tuple[int, int, int]]:
        """(lease, prompt, oldest version) of the groups dropped as stale since the last call."""
        with self.lock:
            dropped, self.dropped = self.dropped, []
            return dropped

    def take_skipped(self) -> list[Group]:
        """The groups `take` skipped since the last call."""
        with self.lock:
            skipped, self.skipped = self.skipped, []
            return skipped

    def trained(self, groups: int, version: int | None) -> None:
        """A step consumed `groups` (after its version went out): capacity for new leases."""
        with self.lock:
            self.book.close(groups)
            if version is not None:
                self.version = version
            self.lock.notify_all()

    def finish(self, linger: float) -> None:
        """Tells every worker the run is over (at its next lease request), waiting up to
        `linger` s for the workers heard from in the last minute to have been told."""
        deadline = time.monotonic() + linger
        with self.lock:
            self.finished = True
            self.lock.notify_all()
        while time.monotonic() < deadline:
            with self.lock:
                recent = {s for s, t in self.last_request.items() if time.monotonic() - t < 60}
                if recent <= self.told_done:
                    return
            time.sleep(0.1)

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "book": self.book.state_dict(),
                "receiver": None if self.receiver is None else self.receiver.state_dict(),
                "ready": [
                    (g.lease, g.prompt, [dataclasses.asdict(t) for t in g.trajectories])
                    for g in self.ready
                ],
                "partial": [
                    (lease, prompt, [dataclasses.asdict(t) for t in part])
                    for (lease, prompt), part in self.partial.items()
                ],
                "skipped": [
                    (g.lease, g.prompt, [dataclasses.asdict(t) for t in g.trajectories])
                    for g in self.skipped
                ],
                "counts": dict(self.counts),  # run totals continue across a resume
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.book.load_state_dict(state["book"], time.monotonic())
            if self.receiver is not None and state["receiver"] is not None:
                self.receiver.load_state_dict(state["receiver"])
            self.ready = deque(
                Group(lease, prompt, [Trajectory(**t) for t in part])
                for lease, prompt, part in state["ready"]
            )
            self.partial = {
                (lease, prompt): [Trajectory(**t) for t in part]
                for lease, prompt, part in state["partial"]
            }
            self.skipped = [
                Group(lease, prompt, [Trajectory(**t) for t in part])
                for lease, prompt, part in state.get("skipped", [])
            ]
            self.counts |= state.get("counts", {})

    def snapshot_counts(self) -> dict[str, Any]:
        with self.lock:
            return {
                "queue/ready_groups": len(self.ready),
                "queue/partial_groups": len(self.partial),
                "queue/open_groups": self.book.open_groups,
                "queue/leases": len(self.book.leases),
                "data/next_prompt": self.book.next_prompt,
                "data/expired_groups": self.book.expired_groups,
                "counts": dict(self.counts),
                "workers": {name: dict(stats) for name, stats in self.workers.items()},
                "rejected": 0 if self.receiver is None else self.receiver.rejected,
                "rejected_by_source": {}
                if self.receiver is None
                else dict(self.receiver.rejections.counts),
                "duplicates": 0 if self.receiver is None else self.receiver.duplicates,
            }

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.receiver is not None:
            self.receiver.close()
