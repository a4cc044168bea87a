"""Addition of two fixed-width numbers, from a space no run can memorize (10^(2·digits)).
Why the worked answer form, and the held-out split: docs/running.md, 'Tasks'.

    Q: 0482+7396
    A: 2+6+0=08 8+9+0=17 4+3+1=08 0+7+0=07 #07878      (worked; reversed: 87870)
"""

from __future__ import annotations

import functools
import random
import re

from .base import Prompt, RewardFn, Task, check_heldout_fraction, is_heldout

ANSWER_FORMATS = ("worked", "reversed")
FINAL_MARKER = "#"


def worked_answer(a: int, b: int, digits: int, drops_carry=None) -> str:
    """` 2+6+0=08 8+9+0=17 ... #07878`: the per-digit steps, then the sum.

    `drops_carry()`, when given, is asked at every step that should add a carry of 1;
    when it says True the step adds 0 instead, and everything after follows from that
    (a sloppy teacher: its answer is wrong, and consistent with its own steps)."""
    steps, carry, total_digits = [], 0, []
    for position in range(digits):
        x, y = a // 10**position % 10, b // 10**position % 10
        if carry and drops_carry is not None and drops_carry():
            carry = 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        total_digits.append(total % 10)
        carry = total // 10
    stated = "".join(map(str, [carry, *reversed(total_digits)]))
    return " " + " ".join(steps) + f" {FINAL_MARKER}{stated}"


def reversed_answer(a: int, b: int, digits: int) -> str:
    """` 87870`: the n+1 digits of a + b, least significant first."""
    return " " + f"{a + b:0{digits + 1}d}"[::-1]


def read_sum(completion: str, answer_format: str) -> int | None:
    """The sum a completion states, or None when it states none: for `worked` the digits
    right after the last `#`, for `reversed` the first word (all digits) read back to
    front."""
    if answer_format == "worked":
        if FINAL_MARKER not in completion:
            return None
        match = re.match(r"\d+", completion.rsplit(FINAL_MARKER, 1)[1], re.ASCII)
        return int(match.group()) if match else None
    words = completion.split()
    return int(words[0][::-1]) if words and re.fullmatch(r"\d+", words[0], re.ASCII) else None


def sum_reward(completion: str, answer: str, answer_format: str = "worked") -> float:
    """1 when the sum the completion states (after the last `#` for `worked`, the first
    word read back to front for `reversed`) equals `answer`, else 0."""
    return 1.0 if read_sum(completion, answer_format) == int(answer) else 0.0


class AdditionTask(Task):
    name = "addition"

    def __init__(
        self,
        reward: RewardFn | None = None,
        seed: int = 0,
        digits: int = 3,
        answer_format: str = "worked",
        heldout_fraction: float = 0.1,
    ):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"addition: task.answer_format must be one of {', '.join(ANSWER_FORMATS)}, "
                f"got {answer_format!r}"
            )
        super().__init__(reward or functools.partial(sum_reward, answer_format=answer_format))
        check_heldout_fraction("addition", heldout_fraction)
        if not 1 <= digits <= 9:
            raise ValueError(f"addition: task.digits must be in 1..9, got {digits}")
        self.seed, self.digits, self.answer_format = seed, digits, answer_format
        self.heldout_fraction = heldout_fraction
        self.space = 10 ** (2 * digits)
        heldout = round(self.space * heldout_fraction)
        if heldout_fraction > 0 and heldout < 256:
            raise ValueError(
                f"addition: task.digits={digits} with task.heldout_fraction={heldout_fraction} "
                f"holds out about {heldout} of {self.space} problems; held-out evaluation needs "
                "at least 256: raise digits or heldout_fraction"
            )

    def expression(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}"

    def _prompt(self, index: int, a: int, b: int) -> Prompt:
        expression = self.expression(a, b)
        return Prompt(
            index=index,
            text=f"Q: {expression}\nA:",
            answer=str(a + b),
            meta={"expression": expression, "a": a, "b": b},
        )

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        top = 10**self.digits
        return rng.randrange(top), rng.randrange(top)

    def prompt(self, index: int) -> Prompt:
        # One generator per index: prompt i is the same whatever was asked before it;
        # a held-out draw is replaced by the generator's next one.
        rng = random.Random(f"addition:{self.seed}:{index}")
        while True:
            a, b = self._draw(rng)
            if not is_heldout(self.expression(a, b), self.heldout_fraction):
                return self._prompt(index, a, b)

    def heldout_prompts(self, count: int) -> list[Prompt]:
        """`count` distinct held-out problems, the same for every seed (and for every
        `answer_format`: the split depends on the expression only)."""
        if self.heldout_fraction == 0:
            raise ValueError(
                "addition: task.heldout_fraction is 0, so there are no held-out prompts to "
                "evaluate on: set it above 0, or turn evaluation off with eval.every=0"
            )
        prompts: list[Prompt] = []
        seen: set[str] = set()
        rng = random.Random(f"addition-heldout:{self.digits}")
        for _ in range(1000 * count):
            a, b = self._draw(rng)
            expression = self.expression(a, b)
            if expression not in seen and is_heldout(expression, self.heldout_fraction):
                seen.add(expression)
                prompts.append(self._prompt(len(prompts), a, b))
                if len(prompts) == count:
                    break
        return prompts

    def completion(self, prompt: Prompt) -> str:
        """The reference completion, for supervised warm-starts."""
        a, b = prompt.meta["a"], prompt.meta["b"]
        if self.answer_format == "worked":
            return worked_answer(a, b, self.digits)
        return reversed_answer(a, b, self.digits)

    def sloppy_completion(self, prompt: Prompt, carry_drop: float, seed: int) -> str:
        """The worked answer of a teacher that forgets each carry with probability
        `carry_drop` (the same draws for the same prompt index and seed)."""
        if self.answer_format != "worked":
            raise ValueError("addition: a sloppy teacher needs task.answer_format=worked")
        rng = random.Random(f"addition-teacher:{seed}:{prompt.index}")
        a, b = prompt.meta["a"], prompt.meta["b"]
        return worked_answer(a, b, self.digits, lambda: rng.random() < carry_drop)
