"""Pulling the final number out of a model's text, and comparing numbers exactly.

Numbers are compared as decimals, so "1,000", "1000" and "1000.00" are one answer and
no float rounding decides a reward.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A thousands-grouped number ("12,345.5") or a plain one ("-42", "3.14"); "$" and a
# trailing full stop are left outside the match.
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_GSM8K_MARKER = re.compile(r"####\s*\$?\s*(" + NUMBER.pattern + ")")
_BOXED = re.compile(r"\\boxed\{\s*\$?\s*(" + NUMBER.pattern + r")\s*\}")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*\$?\s*(" + NUMBER.pattern + ")", re.IGNORECASE)


def parse_number(text: str) -> Decimal | None:
    """`text` as an exact decimal ("1,234.50" -> 1234.5), or None if it is not a number."""
    try:
        return Decimal(text.strip().lstrip("$").replace(",", ""))
    except InvalidOperation:
        return None


def number_after_marker(text: str, marker: str) -> Decimal | None:
    """The number that directly follows the last `marker` in `text` (or starts `text`
    when the marker is absent, as when the prompt ended with it). Anything other than
    whitespace between the marker and the number means there is no answer."""
    tail = text.rsplit(marker, 1)[-1]
    match = re.match(r"\s*(" + NUMBER.pattern + ")", tail)
    return parse_number(match.group(1)) if match else None


def final_number(text: str) -> Decimal | None:
    """The final answer of a free-form solution, tried in order of how explicit it is:
    the GSM8K marker ("#### 42"), a LaTeX box ("\\boxed{42}"), "the answer is 42",
    and last of all the last number in the text."""
    for pattern in (_GSM8K_MARKER, _BOXED, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches:
            return parse_number(matches[-1])
    numbers = NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def same_number(predicted: Decimal | None, expected: str | Decimal) -> bool:
    if predicted is None:
        return False
    expected_value = parse_number(expected) if isinstance(expected, str) else expected
    return expected_value is not None and predicted == expected_value
