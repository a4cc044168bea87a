"""`python -m asyncfp8.report --tables A.json B.json`: tables an earlier report wrote
(`--json`), pooled group by group (the same label). A study run in parts keeps its tables
in docs/results/ and its run directories nowhere: the seeds of every part count together,
each group's numbers computed again from its runs' summaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncfp8.report.group_stats import group_numbers

_OF_A_TABLE = ("label", "paired_")  # keys a pooled entry gets anew, never from a part


def pool_tables(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """(the pooled groups in order of first appearance, every run's summary by run name).
    ValueError naming the tables for a file that is not a report's table, a run in two
    tables, or one label whose settings differ between tables."""
    origin: dict[str, str] = {}  # run -> its table
    summaries: dict[str, dict] = {}
    parts: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # label -> (table, its group)
    for path in paths:
        table = _read(path)
        by_run = {row["run"]: row for row in table["runs"]}
        for group in table["groups"]:
            parts.setdefault(group["label"], []).append((path, group))
            for run in group["runs"]:
                if run in origin:
                    raise ValueError(f"run {run} is in both {origin[run]} and {path}")
                origin[run], summaries[run] = path, by_run[run]
    entries = []
    for label, found in parts.items():
        runs = [run for _, group in found for run in group["runs"]]
        seeds = [seed for _, group in found for seed in group["seeds"]]
        numbers = group_numbers(runs, seeds, summaries)
        first, settings = found[0][0], _settings(found[0][1], numbers)
        for path, group in found[1:]:
            if (other := _settings(group, numbers)) != settings:
                raise ValueError(
                    f"{label!r} has other settings in {path} than in {first}: "
                    f"{other} against {settings}"
                )
        entries.append({"label": label, **settings, **numbers})
    return entries, summaries


def _read(path: str) -> dict[str, Any]:
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON table ({error})") from error
    if not isinstance(table, dict) or not {"runs", "groups"} <= table.keys():
        raise ValueError(
            f"{path} is not a table that `python -m asyncfp8.report --json` wrote "
            '(no "runs" and "groups")'
        )
    return table


def _settings(group: dict[str, Any], numbers: dict[str, Any]) -> dict[str, Any]:
    """The group's settings: what a saved entry holds beyond the numbers of its runs."""
    return {
        key: value
        for key, value in group.items()
        if key not in numbers and not key.startswith(_OF_A_TABLE)
    }
