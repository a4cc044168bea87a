"""The guard's rules (`guard.*`): does this batch show that the previous update broke the
policy? Pure Python over one batch's evidence, summed over the learner's ranks, and the
batches that passed; train/step.py and train/rollback.py act on the verdict. The signals
(far tokens, far share, dead reward) and why each default is what it is:
docs/running.md#the-guard-undoing-a-fatal-step."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from asyncfp8.correction.metrics import FAR_LOG_RATIO

MIN_HISTORY = 5  # batches that passed before a median means anything
# A batch that scored nothing is judged dead only where chance alone would do that at most
# this often (samples taken as independent at the running median's rate).
DEAD_REWARD_CHANCE = 1e-4


@dataclass(frozen=True)
class GuardSettings:
    """`guard.*`, checked: `from_config` refuses a bad value naming its key."""

    enabled: bool = True
    max_rollbacks: int = 3
    log_ratio_bound: float = 20.0
    far_tokens: int = 12
    far_fraction: float = 0.1
    reward_good: float = 0.2
    window: int = 20
    keep_states: int = 2
    dead_batches: int = 3
    reward_low: float = 0.3
    shrink: float = 0.5
    shrink_steps: int = 20
    heldout_below: float = 0.5

    @classmethod
    def from_config(cls, guard: Any) -> GuardSettings:
        values = {f.name: guard[f.name] for f in fields(cls) if f.name in guard}
        for key, value in values.items():
            _check_type(key, value)
        settings = cls(**values)
        for key in _COUNTS:
            if getattr(settings, key) < 1:
                raise ValueError(f"guard.{key} must be >= 1, got {getattr(settings, key)}")
        if not settings.log_ratio_bound > 1:
            raise ValueError(f"guard.log_ratio_bound must be > 1, got {settings.log_ratio_bound}")
        for key in ("far_fraction", "reward_good"):
            if not 0 < getattr(settings, key) <= 1:
                raise ValueError(f"guard.{key} must be in (0, 1], got {getattr(settings, key)}")
        if not 0 <= settings.reward_low < 1:
            raise ValueError(
                f"guard.reward_low must be in [0, 1) (0: only batches that score nothing), "
                f"got {settings.reward_low}"
            )
        if not 0 < settings.shrink <= 1:
            raise ValueError(f"guard.shrink must be in (0, 1] (1: off), got {settings.shrink}")
        if not 0 <= settings.heldout_below < 1:
            raise ValueError(
                f"guard.heldout_below must be in [0, 1) (0: off), got {settings.heldout_below}"
            )
        return settings


_COUNTS = ("max_rollbacks", "far_tokens", "window", "keep_states", "dead_batches", "shrink_steps")


def _check_type(key: str, value: Any) -> None:
    """The schema types `guard.*` when Hydra composes it; this also holds for a config
    built another way (a dict, a test)."""
    kind = bool if key == "enabled" else int if key in _COUNTS else float
    if kind is bool:
        right = isinstance(value, bool)
    elif kind is int:
        right = isinstance(value, int) and not isinstance(value, bool)
    else:
        right = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not right:
        raise ValueError(f"guard.{key} must be a {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class Verdict:
    """A batch that failed: which signal, the setting that bounds it, and what it saw."""

    signal: str  # far_tokens | far_fraction | dead_reward
    setting: str
    detail: str


@dataclass
class Evidence:
    """One batch's evidence, summed over its micro-batches and then over ranks: real tokens,
    those beyond the bound and beyond 5, the sum of their k3, samples and samples rewarded
    (reward > 0); and, counted but not judged, tokens of ignored versions, tokens excused
    (far from the rollout, near their own version) and tokens raised above their version."""

    tokens: float = 0.0
    far_tokens: float = 0.0
    far5_tokens: float = 0.0
    k3_sum: float = 0.0
    samples: float = 0.0
    rewarded: float = 0.0
    ignored_tokens: float = 0.0
    excused_tokens: float = 0.0
    raised_tokens: float = 0.0

    @property
    def k3(self) -> float:
        return self.k3_sum / max(self.tokens, 1.0)

    @property
    def far_fraction(self) -> float:
        return self.far5_tokens / max(self.tokens, 1.0)

    @property
    def reward_frac(self) -> float:
        return self.rewarded / max(self.samples, 1.0)


def binomial_at_most(k: float, n: float, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p): the chance that n samples rewarded at rate p
    score at most k (samples taken as independent, which flatters a batch of groups of
    one prompt: DEAD_REWARD_CHANCE is set far out for that)."""
    k, n = int(k), int(n)
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * log_p
        + (n - i) * log_q
        for i in range(k + 1)
    ]
    top = max(terms)
    return math.exp(top) * sum(math.exp(t - top) for t in terms)


class GuardRules:
    """The verdicts, the history of the batches that passed, and the streak of dead ones."""

    def __init__(self, settings: GuardSettings):
        self.settings = settings
        self.reward_history: deque[float] = deque(maxlen=settings.window)
        self.dead_streak = 0  # dead batches in a row, short of guard.dead_batches

    @property
    def pending(self) -> bool:
        """A streak of dead batches has begun: the latest batch neither passed nor failed."""
        return self.dead_streak > 0

    def judge(self, evidence: Evidence) -> Verdict | None:
        """The first signal the batch trips, or None (and the batch joins the history
        unless it is one of a dead streak). A batch with no evidence (every sample left
        out) trips nothing and leaves the streak as it is."""
        verdict = self._verdict(evidence)
        if evidence.samples > 0:
            if verdict is not None:
                self.dead_streak = 0
            elif self.dead(evidence):
                self.dead_streak += 1
                if self.dead_streak >= self.settings.dead_batches:
                    verdict = self._dead_verdict(evidence)
                    self.dead_streak = 0
            else:
                self.dead_streak = 0
                self.reward_history.append(evidence.reward_frac)
        return verdict

    def _verdict(self, evidence: Evidence) -> Verdict | None:
        s = self.settings
        if evidence.far_tokens >= s.far_tokens:
            return Verdict(
                "far_tokens",
                "guard.log_ratio_bound",
                f"{evidence.far_tokens:.0f} of {evidence.tokens:.0f} tokens with |log ρ| > "
                f"{s.log_ratio_bound:g} (guard.far_tokens={s.far_tokens})",
            )
        if evidence.far_fraction > s.far_fraction:
            return Verdict(
                "far_fraction",
                "guard.far_fraction",
                f"{evidence.far_fraction:.1%} of {evidence.tokens:.0f} tokens with |log ρ| > "
                f"{FAR_LOG_RATIO:g} (guard.far_fraction={s.far_fraction:g})",
            )
        return None

    def dead(self, evidence: Evidence) -> bool:
        """No sample rewarded, or a share below `guard.reward_low` of the median, from a
        policy that scored, in a batch too large for chance to score so little."""
        if evidence.samples <= 0 or len(self.reward_history) < MIN_HISTORY:
            return False
        median = statistics.median(self.reward_history)
        low = evidence.rewarded == 0 or evidence.reward_frac < self.settings.reward_low * median
        return (
            low
            and median >= self.settings.reward_good
            and binomial_at_most(evidence.rewarded, evidence.samples, median) <= DEAD_REWARD_CHANCE
        )

    def _dead_verdict(self, evidence: Evidence) -> Verdict:
        s = self.settings
        return Verdict(
            "dead_reward",
            "guard.reward_good",
            f"{s.dead_batches} batch(es) in a row with no sample rewarded or under "
            f"guard.reward_low={s.reward_low:g} x the median (the last: {evidence.rewarded:.0f} "
            f"of {evidence.samples:.0f}; guard.dead_batches={s.dead_batches}), after batches "
            f"with a median of {self.reward_median():.2f} rewarded "
            f"(guard.reward_good={s.reward_good:g})",
        )

    def reward_median(self) -> float:
        """The running median the next batch's reward is judged against (NaN before any)."""
        history = self.reward_history
        return statistics.median(history) if history else float("nan")
