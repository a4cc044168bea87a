"""GSM8K-format word problems read from a JSONL file.

Each line is `{"question": ..., "answer": "... #### N"}`, as in the GSM8K release.
The whole file is checked when the task is built, so a bad line fails the run at
start with its line number, not hours later when a worker reaches it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .answers import final_number, parse_number, same_number
from .base import FileTask, Prompt, RewardFn, check_heldout_fraction
from .verified import math_verify_reward

SAMPLE_FILE = "gsm8k_sample.jsonl"
PROMPT_TEMPLATE = "Q: {question}\nA:"


def bundled_sample_path() -> Path:
    """The project's own 300-problem sample in GSM8K format (see scripts/make_gsm8k_sample.py)."""
    return Path(str(resources.files("asyncfp8.tasks") / "data" / SAMPLE_FILE))


def final_number_reward(completion: str, answer: str) -> float:
    return 1.0 if same_number(final_number(completion), answer) else 0.0


def read_gsm8k_jsonl(path: str | Path) -> list[dict[str, str]]:
    """Records with `question`, `answer` (the full solution) and `final` (the number
    after "####"). Raises ValueError naming the file and line of the first bad record."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"gsm8k_jsonl: no such file {str(path)!r} (expected a JSONL file of "
            '{"question": ..., "answer": "... #### N"} lines)'
        )
    records = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for key in ("question", "answer"):
                if not isinstance(record.get(key), str) or not record[key].strip():
                    raise ValueError(f"{where}: expected a non-empty string field {key!r}")
            if "####" not in record["answer"]:
                raise ValueError(f"{where}: answer has no '#### N' final answer")
            final = record["answer"].rsplit("####", 1)[1].strip()
            if parse_number(final) is None:
                raise ValueError(f"{where}: the text after '####' is {final!r}, not a number")
            records.append(
                {"question": record["question"], "answer": record["answer"], "final": final}
            )
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class GSM8KJsonlTask(FileTask):
    """The records of a file, reshuffled every pass, less a `heldout_fraction` of them
    (chosen by a hash of the question) kept for held-out evaluation."""

    name = "gsm8k_jsonl"
    item = "record"

    def __init__(
        self,
        reward: RewardFn = math_verify_reward,
        path: str | None = None,
        seed: int = 0,
        heldout_fraction: float = 0.2,
    ):
        super().__init__(reward)
        check_heldout_fraction("gsm8k_jsonl", heldout_fraction)
        self.path = Path(path) if path else bundled_sample_path()
        self.records = read_gsm8k_jsonl(self.path)
        self.seed = seed
        self._split([r["question"] for r in self.records], heldout_fraction)

    def _prompt(self, index: int, record_index: int) -> Prompt:
        record = self.records[record_index]
        return Prompt(
            index=index,
            text=PROMPT_TEMPLATE.format(question=record["question"]),
            answer=record["final"],
            meta={"record": record_index, "solution": record["answer"]},
        )

    def completion(self, prompt: Prompt) -> str:
        return " " + prompt.meta["solution"]
