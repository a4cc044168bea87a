"""bench/longtail.py on the tiny model at a small shape: every mode generates every
budget, the same tokens in FP32, and the JSON carries the rows the docs read. Durations
are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_longtail_bench_writes_its_rows(tmp_path):
    out = tmp_path / "longtail.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "longtail.py"),
            "--model=tiny",
            "--batch=12",
            "--slots=3",
            "--short-min=2",
            "--short-max=4",
            "--long-every=4",
            "--long-factor=10",
            "--repeats=1",
            "--dtype=float32",
            "--train-rounds=2",
            "--train-steps=40",
            "--threshold=2",
            "--patience=1",
            f"--out={out}",
        ],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["cores"] >= 1 and data["same_tokens_in_every_mode"] is True
    budgets = data["budgets"]
    assert len(budgets) == 12 and budgets[3] == budgets[7] == budgets[11] == 30
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"static", "continuous", "static_batches", "speculative", "adaptive"}
    for mode, row in rows.items():
        assert row["tokens"] == sum(budgets)
        assert row["seconds"] > 0 and row["tokens_per_s"] > 0
        if mode in ("speculative", "adaptive"):
            # The trained drafter's drafts are accepted: fewer target forwards per token.
            assert row["mean_accepted_length"] > 1.0
            assert row["target_forwards_per_token"] < 1.0
            assert 0 < row["fraction_steps_speculating"] <= 1.0
        else:
            assert row["target_forwards_per_token"] == 1.0  # no speculation: one per token
    assert rows["speculative"]["fraction_steps_speculating"] == 1.0
    # The static batch runs until its longest budget; three refilled slots run the long
    # ones side by side; batches of three run until each one's longest.
    assert rows["static"]["decode_steps"] == max(budgets) - 1
    chunks = [budgets[i : i + 3] for i in range(0, 12, 3)]
    assert rows["static_batches"]["decode_steps"] == sum(max(c) - 1 for c in chunks)
    assert rows["continuous"]["decode_steps"] < rows["static_batches"]["decode_steps"]
    assert rows["continuous"]["row_steps_per_token"] < rows["static"]["row_steps_per_token"]
    assert "continuous" in result.stdout and "adaptive" in result.stdout


@pytest.mark.slow
def test_longtail_bench_refuses_what_it_cannot_run():
    """Refused before any model is built: a shaped model with a quantizing precision (one
    model is shared by every mode), slots beyond the batch."""
    for args, message in (
        (["--model=qwen2.5-1.5b-shaped", "--precision=fp8"], "--precision bf16"),
        (["--batch=4", "--slots=8"], "--slots must be in 1..--batch"),
    ):
        result = subprocess.run(
            [sys.executable, str(REPO / "bench" / "longtail.py"), *args],
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_a_mode_that_fails_keeps_its_finished_repeats_and_each_round_is_saved(
    tmp_path, monkeypatch
):
    """A mode whose timed run fails (here: continuous, at its second repeat) keeps the
    repeats it finished and says why it stopped; the other modes go on; the JSON is
    rewritten after every round of repeats."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import longtail
    finally:
        sys.path.remove(str(REPO / "bench"))
    on_disk = []
    real_save, real_timed_run = longtail.Table.save, longtail.timed_run
    calls = {"continuous": 0}

    def save(table):
        path = real_save(table)
        rows = json.loads(path.read_text())["rows"]
        on_disk.append({r["mode"]: (r.get("repeats_done"), "error" in r) for r in rows})
        return path

    def timed_run(engine, prompts, budgets, sampling, chunk=None):
        if engine.slots == 2 and chunk is None:  # continuous
            calls["continuous"] += 1
            if calls["continuous"] == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_timed_run(engine, prompts, budgets, sampling, chunk)

    monkeypatch.setattr(longtail.Table, "save", save)
    monkeypatch.setattr(longtail, "timed_run", timed_run)
    out = tmp_path / "longtail.json"
    settings = ["--model=tiny", "--batch=4", "--slots=2", "--short-min=2", "--short-max=3"]
    settings += ["--long-every=4", "--long-factor=2", "--repeats=2", "--dtype=float32"]
    assert longtail.main([*settings, "--modes=static,continuous", f"--out={out}"]) == 1
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["static"]["repeats_done"] == 2 and "error" not in rows["static"]
    assert rows["continuous"]["repeats_done"] == 1 and len(rows["continuous"]["times"]) == 1
    assert rows["continuous"]["error"].startswith("RuntimeError: CUDA error: an illegal memory")
    rounds = [state for state in on_disk if state]
    assert rounds[0] == {"static": (1, False), "continuous": (1, False)}  # the first round
    assert rounds[-1] == {"static": (2, False), "continuous": (1, True)}
