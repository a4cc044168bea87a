"""Users' own prompts: a local JSONL, JSON, parquet or CSV file, or a `save_to_disk` directory,
read with the `datasets` library (never from the hub). A row is a text prompt or chat
`messages` plus an answer (columns: the `fields` map), rendered through the model's chat
template when it has one. The whole file is checked when the task is built: a bad row stops
the run at start with `file:row` (docs/running.md, 'Tasks')."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncfp8.hf.directory import load_tokenizer

from .base import FileTask, Prompt, RewardFn, check_heldout_fraction
from .verified import math_verify_reward

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
DEFAULT_FIELDS = {"prompt": "prompt", "messages": "messages", "answer": "answer"}
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE_SETTINGS = ("auto", True, False)
GSM8K_MARKER = "####"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a local data file (or a `save_to_disk` directory), as dicts."""
    import datasets

    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(
                f"task.path={path} is a directory, but not one written by datasets' "
                f"save_to_disk ({err}); give a .jsonl, .json, .parquet or .csv file instead"
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(
                    f"{path}: a DatasetDict without a 'train' split (it has "
                    f"{', '.join(loaded)}); save the split to use with save_to_disk"
                )
            loaded = loaded["train"]
        return loaded.to_list()
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"task.path={path}: cannot tell the format from the suffix {path.suffix!r}; "
            f"expected one of {', '.join(FORMATS)} or a directory written by save_to_disk"
        )
    datasets.disable_progress_bars()  # one log line says what was read instead
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train").to_list()
    except Exception as err:  # datasets wraps the parser's error in its own
        where = first_bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
        cause = err.__cause__ or err
        raise ValueError(where or f"{path}: cannot be read as {builder}: {cause}") from None


def first_bad_json_line(path: Path) -> str | None:
    """Where a JSONL file that `datasets` refused goes wrong, by line: a line that is not
    a JSON object, or a column whose type differs from its first row's (Arrow needs one
    type per column). None when no line explains it."""
    first_seen: dict[str, tuple[str, int]] = {}
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})"
            if not isinstance(record, dict):
                return f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
            for column, value in record.items():
                if value is None:
                    continue
                kind = type(value).__name__
                seen = first_seen.setdefault(column, (kind, number))
                if seen[0] != kind and {seen[0], kind} != {"int", "float"}:
                    return (
                        f"{path}:{number}: column {column!r} is a {kind} here but a {seen[0]} "
                        f"on line {seen[1]}; a column keeps one type in every row"
                    )
    return None


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def check_messages(messages: Any, where: str, column: str) -> list[dict[str, str]]:
    """The row's chat turns, or ValueError saying what is wrong at `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: {column!r} must be a non-empty list of {{'role', 'content'}} messages, "
            f"got {type(messages).__name__}"
        )
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping) or not _text(message.get("content")):
            raise ValueError(
                f"{where}: {column}[{number}] must be a mapping with a non-empty string "
                f"'content', got {message!r:.80}"
            )
        if message.get("role") not in ROLES:
            raise ValueError(
                f"{where}: {column}[{number}] has role {message.get('role')!r}; expected one "
                f"of {', '.join(ROLES)}"
            )
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    # A trailing assistant turn is the reference answer of SFT-style data, not prompt.
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not any(turn["role"] == "user" for turn in turns):
        raise ValueError(f"{where}: {column!r} has no user message before the last assistant turn")
    return turns


def gold_answer(value: Any, where: str, column: str) -> str:
    """The answer the reward compares with: the text itself, or the part after a GSM8K
    '####' marker when the column holds a whole worked solution."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{where}: answer column {column!r} must be a string or a number, got "
            f"{type(value).__name__}"
        )
    text = str(value).strip()
    if GSM8K_MARKER in text:
        text = text.rsplit(GSM8K_MARKER, 1)[1].strip()
    if not text:
        raise ValueError(f"{where}: answer column {column!r} is empty")
    return text


class DatasetTask(FileTask):
    """The rows of a user's file, reshuffled every pass, less a `heldout_fraction` of them
    (chosen by a hash of the prompt) kept for held-out evaluation."""

    name = "dataset"
    item = "row"

    def __init__(
        self,
        reward: RewardFn = math_verify_reward,
        path: str | None = None,
        fields: Mapping[str, str] | None = None,
        system_prompt: str | None = None,
        chat_template: str | bool = "auto",
        text_template: str = "{prompt}",
        heldout_fraction: float = 0.1,
        seed: int = 0,
        model_dir: str | Path | None = None,
    ):
        super().__init__(reward)
        check_heldout_fraction("dataset", heldout_fraction)
        if not path:
            raise ValueError(
                "task=dataset needs task.path: a local .jsonl, .json, .parquet or .csv file, "
                "or a directory written by datasets' save_to_disk"
            )
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"task.path={self.path}: no such file or directory")
        unknown = set(fields or {}) - set(DEFAULT_FIELDS)
        if unknown:
            raise ValueError(
                f"task.fields: unknown key(s) {sorted(unknown)}; the map has "
                f"{', '.join(DEFAULT_FIELDS)} (each the column that holds it)"
            )
        self.fields = {**DEFAULT_FIELDS, **(fields or {})}
        if chat_template not in CHAT_TEMPLATE_SETTINGS:
            raise ValueError(
                f"task.chat_template must be auto, true or false, got {chat_template!r}"
            )
        if "{prompt}" not in text_template:
            raise ValueError(f"task.text_template must contain '{{prompt}}', got {text_template!r}")
        self.system_prompt, self.text_template, self.seed = system_prompt, text_template, seed
        self.tokenizer = self._chat_tokenizer(chat_template, model_dir)
        started = time.perf_counter()
        self.rows = [self._row(row, number) for number, row in enumerate(read_rows(self.path), 1)]
        if not self.rows:
            raise ValueError(f"task.path={self.path}: no rows")
        self._split([row["key"] for row in self.rows], heldout_fraction)
        log.info(
            "task dataset: %d rows of %s (%d training, %d held out) read and checked in %.1f s; "
            "prompts %s",
            len(self.rows),
            self.path,
            len(self.train_items),
            len(self.heldout_items),
            time.perf_counter() - started,
            "rendered with the model's chat template"
            if self.tokenizer is not None
            else f"as text ({self.text_template!r}, no chat template)",
        )

    @staticmethod
    def _chat_tokenizer(setting: str | bool, model_dir: str | Path | None):
        """The tokenizer whose chat template renders the prompts, or None for plain text."""
        if setting is False:
            return None
        if model_dir is None:
            if setting is True:
                raise ValueError(
                    "task.chat_template=true but the task was built without the model "
                    "(build_task(cfg.task, model_dir=...))"
                )
            return None
        tokenizer = load_tokenizer(model_dir)
        if tokenizer.chat_template is None:
            if setting is True:
                raise ValueError(
                    f"task.chat_template=true but the model's tokenizer ({model_dir}) has no "
                    "chat template; set task.chat_template=auto or false for text prompts"
                )
            return None
        return tokenizer

    def _row(self, row: dict[str, Any], number: int) -> dict[str, Any]:
        """One row checked and rendered: its prompt text, gold answer and split key."""
        where = f"{self.path}:{number}"
        prompt_column, messages_column = self.fields["prompt"], self.fields["messages"]
        answer_column = self.fields["answer"]
        # Arrow gives every row every column of the file: an absent one reads as None.
        present = ", ".join(column for column, value in row.items() if value is not None)
        if row.get(answer_column) is None:
            raise ValueError(
                f"{where}: no answer column {answer_column!r} (the row has {present}); "
                f"map it with task.fields.answer=COLUMN"
            )
        answer = gold_answer(row[answer_column], where, answer_column)
        if row.get(messages_column) is not None:
            turns = check_messages(row[messages_column], where, messages_column)
            key = json.dumps(turns, sort_keys=True)
        elif row.get(prompt_column) is not None:
            if not _text(row[prompt_column]):
                raise ValueError(
                    f"{where}: prompt column {prompt_column!r} is not a non-empty string"
                )
            turns = [{"role": "user", "content": row[prompt_column]}]
            key = row[prompt_column]
        else:
            raise ValueError(
                f"{where}: neither a prompt column {prompt_column!r} nor a messages column "
                f"{messages_column!r} (the row has {present}); map yours with "
                "task.fields.prompt=COLUMN or task.fields.messages=COLUMN"
            )
        return {"text": self._render(turns, where), "answer": answer, "key": key, "row": number}

    def _render(self, turns: list[dict[str, str]], where: str) -> str:
        if self.system_prompt and turns[0]["role"] != "system":  # the row's own one wins
            turns = [{"role": "system", "content": self.system_prompt}, *turns]
        if self.tokenizer is None:
            if len(turns) > 1 + (turns[0]["role"] == "system"):
                raise ValueError(
                    f"{where}: a conversation of {len(turns)} turns needs a chat template, and "
                    "the model has none (or task.chat_template=false); give text prompts or a "
                    "model with a template"
                )
            body = self.text_template.format(prompt=turns[-1]["content"])
            return f"{turns[0]['content']}\n\n{body}" if turns[0]["role"] == "system" else body
        try:
            text = self.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:
            raise ValueError(
                f"{where}: the model's chat template cannot render this row: "
                f"{type(err).__name__}: {err}"
            ) from None
        bos = self.tokenizer.bos_token
        # The engines tokenize prompts with the tokenizer's special tokens; a template that
        # writes BOS itself would otherwise give the model two.
        if bos and text.startswith(bos) and self.tokenizer("")["input_ids"]:
            text = text[len(bos) :]
        return text

    def _prompt(self, index: int, row_index: int) -> Prompt:
        row = self.rows[row_index]
        return Prompt(index=index, text=row["text"], answer=row["answer"], meta={"row": row["row"]})

    def completion(self, prompt: Prompt) -> str:
        """The gold answer as a completion: what build_task's trial call scores."""
        return " " + prompt.answer
