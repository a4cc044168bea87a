"""Sums and products of small integers, generated on the fly from a seed.

Prompt `Q: 7*8+3\\nA:`, expected completion ` 59`; the reward is 1 when the number right after
the answer marker equals the value (* before +). A `heldout_fraction` of the expressions, by
a hash whatever the seed, never appears in the prompt stream.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .answers import number_after_marker, same_number
from .base import Prompt, RewardFn, Task, check_heldout_fraction, is_heldout

ANSWER_MARKER = "A:"
SUPPORTED_OPS = ("+", "*")


def exact_match_reward(completion: str, answer: str, marker: str = ANSWER_MARKER) -> float:
    return 1.0 if same_number(number_after_marker(completion, marker), answer) else 0.0


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with * binding tighter than +."""
    total, product = 0, operands[0]
    for op, operand in zip(ops, operands[1:], strict=True):
        if op == "*":
            product *= operand
        else:
            total, product = total + product, operand
    return total + product


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(
        self,
        reward: RewardFn = exact_match_reward,
        seed: int = 0,
        max_operand: int = 12,
        min_terms: int = 2,
        max_terms: int = 2,
        ops: Sequence[str] = SUPPORTED_OPS,
        heldout_fraction: float = 0.2,
    ):
        super().__init__(reward)
        check_heldout_fraction("arithmetic", heldout_fraction)
        unknown = sorted(set(ops) - set(SUPPORTED_OPS))
        if not ops or unknown:
            raise ValueError(
                f"arithmetic: ops must be a non-empty subset of {SUPPORTED_OPS}, got {list(ops)}"
            )
        if max_operand < 1:
            raise ValueError(f"arithmetic: max_operand must be >= 1, got {max_operand}")
        if not 2 <= min_terms <= max_terms:
            raise ValueError(
                f"arithmetic: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}"
            )
        self.seed, self.max_operand = seed, max_operand
        self.min_terms, self.max_terms, self.ops = min_terms, max_terms, tuple(ops)
        self.heldout_fraction = heldout_fraction

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        n_terms = rng.randint(self.min_terms, self.max_terms)
        operands = [rng.randint(0, self.max_operand) for _ in range(n_terms)]
        ops = [rng.choice(self.ops) for _ in range(n_terms - 1)]
        expression = str(operands[0]) + "".join(
            f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
        )
        return expression, evaluate(operands, ops)

    def _prompt(self, index: int, expression: str, value: int) -> Prompt:
        return Prompt(
            index=index,
            text=f"Q: {expression}\n{ANSWER_MARKER}",
            answer=str(value),
            meta={"expression": expression},
        )

    def prompt(self, index: int) -> Prompt:
        # One generator per index: prompt i is the same whatever was asked before it.
        # Held-out expressions are drawn again (from the same generator).
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            expression, value = self._draw(rng)
            if not is_heldout(expression, self.heldout_fraction):
                return self._prompt(index, expression, value)

    def heldout_prompts(self, count: int) -> list[Prompt]:
        """Up to `count` distinct held-out expressions (fewer when the split has fewer:
        2-term sums and products of 0..12 have 338 expressions), the same for every seed."""
        if self.heldout_fraction == 0:
            raise ValueError(
                "arithmetic: task.heldout_fraction is 0, so there are no held-out prompts to "
                "evaluate on: set it above 0, or turn evaluation off with eval.every=0"
            )
        prompts: list[Prompt] = []
        seen: set[str] = set()
        # Enough draws to find every held-out expression of a small space (338 here).
        for draw in range(max(100 * count, 20_000)):
            expression, value = self._draw(random.Random(f"heldout:{draw}"))
            if expression not in seen and is_heldout(expression, self.heldout_fraction):
                seen.add(expression)
                prompts.append(self._prompt(len(prompts), expression, value))
                if len(prompts) == count:
                    break
        return prompts

    def completion(self, prompt: Prompt) -> str:
        """The reference completion, for supervised warm-starts."""
        return f" {prompt.answer}"
