"""What every task is: an indexable stream of prompts and a reward function.

Prompts are addressed by index rather than drawn from a hidden iterator, so that the
data position of a run is one integer that a checkpoint can store and restore.
"""

from __future__ import annotations

import hashlib
import math
import random
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


class FileTask(Task):
    """A finite list of items read from a file (`self.path`), reshuffled every pass, less a
    `heldout_fraction` of them, chosen by a hash of each item's key, kept for held-out
    evaluation. A subclass reads its items, calls `_split` with their keys and implements
    `_prompt(index, item)`; `item` names one in messages ("record", "row")."""

    item = "item"

    def _split(self, keys: list[str], fraction: float) -> None:
        heldout = [is_heldout(key, fraction) for key in keys]
        self.train_items = [i for i, held in enumerate(heldout) if not held]
        self.heldout_items = [i for i, held in enumerate(heldout) if held]
        if not self.train_items:
            raise ValueError(
                f"{self.path}: every {self.item} is held out (task.heldout_fraction="
                f"{fraction}); lower it"
            )
        self._epoch_order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Items in the prompt stream (the held-out ones are not)."""
        return len(self.train_items)

    def _order(self, epoch: int) -> list[int]:
        """A fresh shuffle per pass over the file, fixed by (seed, epoch)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(self.train_items)
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def _prompt(self, index: int, item: int) -> Prompt:
        raise NotImplementedError

    def prompt(self, index: int) -> Prompt:
        epoch, offset = divmod(index, len(self.train_items))
        return self._prompt(index, self._order(epoch)[offset])

    def heldout_prompts(self, count: int) -> list[Prompt]:
        """The first `count` held-out items, in file order."""
        if not self.heldout_items:
            raise ValueError(
                f"{self.name}: no {self.item} of {self.path} is held out (task.heldout_fraction "
                "is 0, or the file is small): raise it, or turn evaluation off with eval.every=0"
            )
        return [self._prompt(i, item) for i, item in enumerate(self.heldout_items[:count])]


def check_heldout_fraction(task: str, fraction: float) -> None:
    if not 0 <= fraction < 1:
        raise ValueError(f"{task}: heldout_fraction must be in [0, 1), got {fraction}")


def is_heldout(key: str, fraction: float) -> bool:
    """Whether the prompt keyed `key` (its expression or question) belongs to the held-out
    split: a hash of the key, so the split is the same for every seed, process and run."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 1_000_000 < fraction * 1_000_000
