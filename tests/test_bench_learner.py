"""bench/learner.py's table: a row that fails (its process died, out of memory) is a row
with an `error`, the other rows are still measured, and the JSON is rewritten after every
row. The rows' processes are replaced by made-up measurements: the table is under test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_bench():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import learner
    finally:
        sys.path.remove(str(REPO / "bench"))
    return learner


def test_a_failing_row_leaves_the_others_and_each_row_is_saved_at_once(tmp_path, monkeypatch):
    learner = import_bench()
    rows = [
        ("toy", 8, 64, 256, 1, False),
        ("toy", 8, 64, 512, 1, False),
        ("toy", 8, 64, None, 1, True),
    ]
    monkeypatch.setattr(learner, "DRY_RUN_ROWS", rows)
    on_disk = []
    real_save = learner.Table.save

    def save(table):
        path = real_save(table)
        on_disk.append(
            [r.get("micro_batch_tokens", "-") for r in json.loads(path.read_text())["rows"]]
        )
        return path

    def measure_row(spec, index, folder, device):
        if spec["micro_batch_tokens"] == 512:
            raise RuntimeError("row {'model': 'toy'} failed: out of memory")
        return {
            "step_s": 0.5,
            "tokens_per_s": 1024.0,
            "peak_memory_bytes": 2**30,
            "rss_before_step_bytes": 2**29,
        }

    monkeypatch.setattr(learner.Table, "save", save)
    monkeypatch.setattr(learner, "measure_row", measure_row)
    out = tmp_path / "learner.json"
    assert learner.main(["--dry-run", "--out", str(out)]) == 1  # a row failed
    table = json.loads(out.read_text())
    assert [r["micro_batch_tokens"] for r in table["rows"]] == [256, 512, None]
    assert [r.get("error") for r in table["rows"]] == [
        None,
        "RuntimeError: row {'model': 'toy'} failed: out of memory",
        None,
    ]
    assert table["rows"][2]["step_s"] == 0.5 and table["rows"][2]["activation_checkpointing"]
    assert on_disk[:4] == [[], [256], [256, 512], [256, 512, None]]
