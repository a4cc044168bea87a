"""Sums and products of small integers, generated on the fly from a seed.

Prompt `Q: 7*8+3\nA:`, expected completion ` 59`; the reward is 1 when the number
right after the answer marker equals the value (usual precedence: * before +).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .answers import number_after_marker, same_number
from .base import Prompt, RewardFn, Task

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
    ):
        super().__init__(reward)
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

    def prompt(self, index: int) -> Prompt:
        # One generator per index: prompt i is the same whatever was asked before it.
        rng = random.Random(f"{self.seed}:{index}")
        n_terms = rng.randint(self.min_terms, self.max_terms)
        operands = [rng.randint(0, self.max_operand) for _ in range(n_terms)]
        ops = [rng.choice(self.ops) for _ in range(n_terms - 1)]
        expression = str(operands[0]) + "".join(
            f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
        )
        return Prompt(
            index=index,
            text=f"Q: {expression}\n{ANSWER_MARKER}",
            answer=str(evaluate(operands, ops)),
            meta={"expression": expression},
        )

    def completion(self, prompt: Prompt) -> str:
        """The reference completion, for supervised warm-starts."""
        return f" {prompt.answer}"
