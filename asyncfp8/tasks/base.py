"""What every task is: an indexable stream of prompts and a reward function.

Prompts are addressed by index rather than drawn from a hidden iterator, so that the
data position of a run is one integer that a checkpoint can store and restore.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

RewardFn = Callable[[str, str], float]
"""reward(completion, answer) -> float: the completion is the generated text only."""


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """A named prompt source plus its reward. Subclasses implement `prompt(index)`."""

    name: str = "task"

    def __init__(self, reward: RewardFn):
        if not callable(reward):
            raise TypeError(f"task {self.name!r}: reward must be callable, got {reward!r}")
        self.reward_fn = reward

    def prompt(self, index: int) -> Prompt:
        raise NotImplementedError

    def heldout_prompts(self, count: int) -> list[Prompt]:
        """Up to `count` prompts that `prompt(i)` never returns, the same for every seed:
        what held-out evaluation scores the policy on."""
        raise ValueError(
            f"task {self.name!r} has no held-out prompts: held-out evaluation needs them "
            "(turn it off with eval.every=0)"
        )

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        """Prompts from `start` on, without end (finite datasets cycle, reshuffled)."""
        index = start
        while True:
            yield self.prompt(index)
            index += 1

    def score(self, completion: str, prompt: Prompt) -> float:
        reward = self.reward_fn(completion, prompt.answer)
        try:
            value = float(reward)
        except (TypeError, ValueError):
            raise TypeError(
                f"task {self.name!r}: reward function {self.reward_fn!r} returned "
                f"{reward!r}; expected a number"
            ) from None
        if not math.isfinite(value):
            raise ValueError(f"task {self.name!r}: reward function returned {value}")
        return value


def check_heldout_fraction(task: str, fraction: float) -> None:
    if not 0 <= fraction < 1:
        raise ValueError(f"{task}: heldout_fraction must be in [0, 1), got {fraction}")


def is_heldout(key: str, fraction: float) -> bool:
    """Whether the prompt keyed `key` (its expression or question) belongs to the held-out
    split: a hash of the key, so the split is the same for every seed, process and run."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 1_000_000 < fraction * 1_000_000
