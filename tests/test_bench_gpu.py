"""bench/gpu.sh: `--dry-run` runs every step on the CPU at a toy size through the same
code and the same limits, with only the GPU machine's packages importable
(tests/gpu_machine.py), and brings back what a GPU run would: 9 files in all, a table
per bench and a summary with a line per step. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu_machine import machine_env

REPO = Path(__file__).resolve().parents[1]
BENCH_STEPS = ("quantize", "kernels", "rollout", "moe", "compiled", "learner", "longtail")


def gpu_sh(*args: str, out: Path, timeout: float) -> subprocess.CompletedProcess:
    # The script calls `python3`: this interpreter's, as on the GPU machine its only one.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), *args],
        cwd=REPO,
        env=machine_env() | {"OUT": str(out), "PATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_brings_back_nine_files(tmp_path):
    out = tmp_path / "out"
    done = gpu_sh("--dry-run", out=out, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    tables = {step: out / f"{step}-dry-run.json" for step in BENCH_STEPS}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["summary.txt", "log.txt", *(p.name for p in tables.values())]
    )
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("dry run on the CPU") and "missing" not in summary
    for step in ("pytest-gpu", *BENCH_STEPS):
        assert f"\n{step}: ok after " in summary, summary
    assert "not finished" not in summary
    rows = {step: json.loads(path.read_text())["rows"] for step, path in tables.items()}

    assert len(rows["quantize"]) == 4 and not any("error" in r for r in rows["quantize"])
    # On the CPU the Triton rows fail, each in its own row; the rest are timed.
    for row in rows["kernels"]:
        assert (row["error"] is not None) == ("triton" in row["impl"]), row
        assert row["error"] is not None or row["us"] > 0
    assert {r["kernel"] for r in rows["kernels"]} == {"gemm", "decode_attention"}
    assert [(r["precision"], r["context"], r["batch"]) for r in rows["rollout"]] == [
        (p, c, b)
        for p in ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8")
        for c, batches in (("short", (1, 8, 64)), ("long", (1, 64)))
        for b in batches
    ]
    assert all(r["tokens_per_s"] > 0 and r["fraction_of_floor"] > 0 for r in rows["rollout"])
    moe = json.loads(tables["moe"].read_text())
    assert moe["model"] == "toy qwen3-moe, random init"
    assert [(r["precision"], r["batch"]) for r in rows["moe"]] == [
        (p, b) for p in ("bf16", "fp8") for b in (1, 8, 64)
    ]
    assert all(r["tokens_per_s"] > 0 and r["fraction_of_floor"] > 0 for r in rows["moe"])
    compiled = json.loads(tables["compiled"].read_text())
    assert (
        compiled["compile"] == "on"
        and json.loads(tables["rollout"].read_text())["compile"] == "off"
    )
    assert [(r["precision"], r["context"], r["batch"]) for r in rows["compiled"]] == [
        (p, "short", b) for p in ("bf16", "fp8", "int8") for b in (1, 64)
    ]
    assert all(r["tokens_per_s"] > 0 for r in rows["compiled"])
    assert [r["model"] for r in rows["learner"]] == ["toy"] and rows["learner"][0]["step_s"] > 0
    modes = ["static", "continuous", "static_batches", "speculative", "adaptive"]
    assert [r["mode"] for r in rows["longtail"]] == modes
    assert all(
        r["tokens"] == sum(json.loads(tables["longtail"].read_text())["budgets"])
        for r in rows["longtail"]
    )


def test_steps_are_named_and_an_unknown_one_is_refused_before_anything_runs(tmp_path):
    done = gpu_sh("rollout", "nonsense", out=tmp_path / "out", timeout=60)
    assert done.returncode == 2 and "no step nonsense" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    done = gpu_sh(out=out, timeout=120)
    assert done.returncode == 1 and "sees no CUDA GPU here" in done.stderr, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.txt"]
    assert (out / "log.txt").read_text() == ""  # no step started
