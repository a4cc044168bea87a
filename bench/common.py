"""Shared by the benchmarks: timing and a record of the machine they ran on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


class Table:
    """A benchmark's JSON, written again whole after every row: a run that fails or is
    stopped part-way keeps every row measured before (bench/gpu.sh stops a step at its
    time limit). Each write goes to `<path>.tmp`, then replaces the file, so the file is
    always whole. `path` None: kept in memory only."""

    def __init__(self, path: str | Path | None, **fields):
        self.path = None if path is None else Path(path)
        self.payload = {"machine": machine(), **fields, "rows": []}
        self.rows: list[dict] = self.payload["rows"]
        self.save()

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def update(self, **fields) -> None:
        self.payload.update(fields)
        self.save()

    def save(self) -> Path | None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".tmp")
            partial.write_text(json.dumps(self.payload, indent=2))
            partial.replace(self.path)
        return self.path


def failure(err: BaseException) -> str:
    """A row's `error`: the exception in one line. The traceback goes to stderr (the log)."""
    traceback.print_exception(err, file=sys.stderr)
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
