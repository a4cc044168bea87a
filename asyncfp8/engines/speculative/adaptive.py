"""When to speculate and how far, TLT's adaptive control: speculation pays at small batches
(the long tail), so it turns on after `patience` checks at or below `threshold` and off at
the first above. k is chosen per batch-size bucket by epsilon-greedy on recent tokens/s
(UCB's bonus would need the machine's scale); k = 0, a plain step, may be an arm
(docs/engines.md, "Speculative decoding (pieces)")."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from itertools import pairwise


class SpeculationController:
    def __init__(
        self,
        *,
        threshold: int = 32,
        patience: int = 10,
        ks: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
        buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
        epsilon: float = 0.3,
        epsilon_decay: float = 0.98,
        min_epsilon: float = 0.02,
        window: int = 50,
        seed: int = 0,
    ):
        if threshold <= 0:
            raise ValueError(
                f"speculation threshold must be a batch size >= 1, got {threshold} (speculation "
                "would never switch on)"
            )
        if patience < 1:
            raise ValueError(f"patience must be >= 1 check, got {patience}")
        ks = [int(k) for k in ks]
        if not ks:
            raise ValueError("the set of draft lengths ks is empty: give at least one k")
        if min(ks) < 0 or len(set(ks)) != len(ks):
            raise ValueError(f"draft lengths must be distinct and >= 0, got {ks}")
        buckets = [int(b) for b in buckets]
        if not buckets or buckets[0] < 1 or any(a >= b for a, b in pairwise(buckets)):
            raise ValueError(f"buckets must be strictly increasing batch sizes >= 1, got {buckets}")
        if not 0 <= min_epsilon <= epsilon <= 1 or not 0 < epsilon_decay <= 1:
            raise ValueError(
                "need 0 <= min_epsilon <= epsilon <= 1 and 0 < epsilon_decay <= 1, got "
                f"{min_epsilon}, {epsilon}, {epsilon_decay}"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.threshold, self.patience = threshold, patience
        self.ks, self.buckets = ks, buckets
        self.epsilon, self.epsilon_decay, self.min_epsilon = epsilon, epsilon_decay, min_epsilon
        self.window = window
        self.rng = random.Random(seed)
        self.streak = 0
        self.speculating = False
        self.checks = 0
        self.speculating_checks = 0
        # Per bucket: measured tokens/s per k (last `window`), pulls, last choice.
        self.rewards = {b: {k: deque(maxlen=window) for k in ks} for b in buckets}
        self.pulls = {b: {k: 0 for k in ks} for b in buckets}
        self.last_choice: dict[int, int] = {}

    # -- on / off ---------------------------------------------------------------------------

    def check(self, active_batch: int) -> bool:
        """Call once per decode step with the number of sequences still generating;
        returns whether this step speculates."""
        if active_batch < 0:
            raise ValueError(f"active batch must be >= 0, got {active_batch}")
        self.streak = self.streak + 1 if active_batch <= self.threshold else 0
        self.speculating = self.streak >= self.patience
        self.checks += 1
        self.speculating_checks += self.speculating
        return self.speculating

    # -- draft length -------------------------------------------------------------------------

    def bucket(self, active_batch: int) -> int:
        """The smallest bucket bound at or above the batch (the largest bound beyond)."""
        return next((b for b in self.buckets if active_batch <= b), self.buckets[-1])

    def _value(self, bucket: int, k: int) -> float:
        measured = self.rewards[bucket][k]
        return sum(measured) / len(measured)

    def choose_k(self, active_batch: int) -> int:
        bucket = self.bucket(active_batch)
        untried = [k for k in self.ks if not self.rewards[bucket][k]]
        if untried:
            k = untried[0]
        else:
            pulls = sum(self.pulls[bucket].values())
            epsilon = max(self.min_epsilon, self.epsilon * self.epsilon_decay**pulls)
            if self.rng.random() < epsilon:
                k = self.rng.choice(self.ks)
            else:
                k = max(self.ks, key=lambda arm: self._value(bucket, arm))
        self.last_choice[bucket] = k
        return k

    def report(self, active_batch: int, k: int, tokens: int, seconds: float) -> None:
        """A speculative step (or several) at this batch size and k emitted `tokens`
        tokens in `seconds`."""
        if k not in self.ks:
            raise ValueError(f"k {k} is not one of the controller's draft lengths {self.ks}")
        if tokens < 0 or seconds <= 0:
            raise ValueError(f"need tokens >= 0 and seconds > 0, got {tokens}, {seconds}")
        bucket = self.bucket(active_batch)
        self.rewards[bucket][k].append(tokens / seconds)
        self.pulls[bucket][k] += 1

    # -- metrics and checkpoints ----------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out = {
            "spec/on": float(self.speculating),
            "spec/fraction_speculating": self.speculating_checks / self.checks
            if self.checks
            else 0.0,
        }
        for bucket, k in self.last_choice.items():
            out[f"spec/k/batch<={bucket}"] = k
            tried = [arm for arm in self.ks if self.rewards[bucket][arm]]
            if tried:
                best = max(tried, key=lambda arm: self._value(bucket, arm))
                out[f"spec/best_k/batch<={bucket}"] = best
                out[f"spec/tokens_per_s/batch<={bucket}"] = self._value(bucket, best)
        return out

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.getstate(),
            "streak": self.streak,
            "speculating": self.speculating,
            "checks": self.checks,
            "speculating_checks": self.speculating_checks,
            "rewards": {
                b: {k: list(r) for k, r in arms.items()} for b, arms in self.rewards.items()
            },
            "pulls": {b: dict(arms) for b, arms in self.pulls.items()},
            "last_choice": dict(self.last_choice),
        }

    def load_state_dict(self, state: dict) -> None:
        if set(state["pulls"]) != set(self.buckets) or any(
            set(arms) != set(self.ks) for arms in state["pulls"].values()
        ):
            raise ValueError(
                "controller checkpoint has other buckets or draft lengths than this controller "
                f"({self.buckets}, {self.ks})"
            )
        self.rng.setstate(state["rng"])
        self.streak, self.speculating = state["streak"], state["speculating"]
        self.checks, self.speculating_checks = state["checks"], state["speculating_checks"]
        self.rewards = {
            b: {k: deque(r, maxlen=self.window) for k, r in arms.items()}
            for b, arms in state["rewards"].items()
        }
        self.pulls = {b: dict(arms) for b, arms in state["pulls"].items()}
        self.last_choice = dict(state["last_choice"])
