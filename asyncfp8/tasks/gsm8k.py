"""GSM8K-format word problems read from a JSONL file.

Each line is `{"question": ..., "answer": "... #### N"}`, as in the GSM8K release.
The whole file is checked when the task is built, so a bad line fails the run at
start with its line number, not hours later when a worker reaches it.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from .answers import final_number, parse_number, same_number
from .base import Prompt, RewardFn, Task

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


class GSM8KJsonlTask(Task):
    name = "gsm8k_jsonl"

    def __init__(
        self, reward: RewardFn = final_number_reward, path: str | None = None, seed: int = 0
    ):
        super().__init__(reward)
        self.path = Path(path) if path else bundled_sample_path()
        self.records = read_gsm8k_jsonl(self.path)
        self.seed = seed
        self._epoch_order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> list[int]:
        """A fresh shuffle per pass over the file, fixed by (seed, epoch)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(len(self.records)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def prompt(self, index: int) -> Prompt:
        epoch, offset = divmod(index, len(self.records))
        record_index = self._order(epoch)[offset]
        record = self.records[record_index]
        return Prompt(
            index=index,
            text=PROMPT_TEMPLATE.format(question=record["question"]),
            answer=record["final"],
            meta={"record": record_index, "solution": record["answer"]},
        )

    def completion(self, prompt: Prompt) -> str:
        return " " + prompt.meta["solution"]
