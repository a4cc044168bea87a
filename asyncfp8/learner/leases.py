"""The learner's lease book: which prompts go to which worker, and the oldest version it may
generate them with. It keeps two promises: bounded staleness (AReaL's rule: at most
`(max_staleness + 1) x groups per version` groups open, so a worker that runs ahead waits
instead of making samples that would be dropped) and nothing silently lost (the prompts of
expired leases are handed out again first; the book is checkpointed)."""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lease:
    id: int  # unique across learner restarts: (incarnation << 32) + serial
    serial: int  # the how-many-th lease of the run (seeds sampling reproducibly)
    worker: str
    prompts: list[int]
    min_version: int
    granted_at: float
    pending: set[int] = field(default_factory=set)  # prompts whose group has not come back


class LeaseBook:
    def __init__(self, capacity: int, timeout: float, incarnation: int | None = None):
        if capacity < 1 or timeout <= 0:
            raise ValueError(f"need capacity >= 1 and timeout > 0; got {capacity}, {timeout}")
        self.capacity, self.timeout = capacity, timeout
        # A learner resumed from a checkpoint cannot know which leases its predecessor
        # granted after that checkpoint; a fresh incarnation keeps their ids from
        # colliding with the new ones (their late groups are then simply not owed).
        self.incarnation = secrets.randbits(31) if incarnation is None else incarnation
        self.next_prompt = 0
        self.retry: deque[int] = deque()  # prompts of expired leases, handed out first
        self.leases: dict[int, Lease] = {}
        self.next_lease = 0
        self.open_groups = 0
        self.expired_groups = 0

    def grant(self, worker: str, want: int, version: int, now: float) -> Lease | None:
        """A lease of up to `want` prompts for `worker`, to be generated with version
        >= `version`; None when the staleness bound says wait."""
        count = min(want, self.capacity - self.open_groups)
        if count <= 0:
            return None
        prompts = []
        while len(prompts) < count and self.retry:
            prompts.append(self.retry.popleft())
        while len(prompts) < count:
            prompts.append(self.next_prompt)
            self.next_prompt += 1
        lease = Lease(
            (self.incarnation << 32) + self.next_lease,
            self.next_lease,
            worker,
            prompts,
            version,
            now,
            set(prompts),
        )
        self.leases[lease.id] = lease
        self.next_lease += 1
        self.open_groups += count
        return lease

    def returned(self, lease_id: int, prompt: int) -> bool:
        """A group came back. False when it is not owed (its lease expired, or it was
        already returned): the caller drops it."""
        lease = self.leases.get(lease_id)
        if lease is None or prompt not in lease.pending:
            return False
        lease.pending.remove(prompt)
        if not lease.pending:
            del self.leases[lease_id]
        return True

    def close(self, groups: int) -> None:
        """`groups` returned groups were trained on or dropped: they free capacity."""
        if groups > self.open_groups:
            raise ValueError(f"closing {groups} groups but only {self.open_groups} are open")
        self.open_groups -= groups

    def dropped(self, prompt: int) -> None:
        """A returned group that will not be trained (too stale): it frees its capacity,
        and its prompt is handed out again first, so no prompt is skipped."""
        self.close(1)
        self.retry.append(prompt)

    def expire(self, now: float) -> list[Lease]:
        """Leases not fully returned within `timeout`: their missing prompts go back to
        the front of the queue and stop counting against the bound."""
        overdue = [lease for lease in self.leases.values() if now - lease.granted_at > self.timeout]
        for lease in overdue:
            del self.leases[lease.id]
            missing = sorted(lease.pending)
            self.retry.extend(missing)
            self.open_groups -= len(missing)
            self.expired_groups += len(missing)
        return overdue

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_prompt": self.next_prompt,
            "retry": list(self.retry),
            "next_lease": self.next_lease,
            "open_groups": self.open_groups,
            "expired_groups": self.expired_groups,
            "leases": [
                {
                    "id": lease.id,
                    "serial": lease.serial,
                    "worker": lease.worker,
                    "prompts": lease.prompts,
                    "min_version": lease.min_version,
                    "pending": sorted(lease.pending),
                }
                for lease in self.leases.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        """Restores a checkpointed book. Outstanding leases get a fresh clock: their
        workers resend what the dead learner had not acknowledged."""
        self.next_prompt, self.next_lease = int(state["next_prompt"]), int(state["next_lease"])
        self.retry = deque(int(p) for p in state["retry"])
        self.open_groups, self.expired_groups = (
            int(state["open_groups"]),
            int(state["expired_groups"]),
        )
        self.leases = {
            int(saved["id"]): Lease(
                int(saved["id"]),
                int(saved["serial"]),
                saved["worker"],
                list(saved["prompts"]),
                int(saved["min_version"]),
                now,
                set(saved["pending"]),
            )
            for saved in state["leases"]
        }
