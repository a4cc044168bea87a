"""bench/decode_steps.py: the kernels of a decode step counted on the CPU, per precision."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_count_shows_what_the_fused_linears_remove(tmp_path):
    out = tmp_path / "steps.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "decode_steps.py"),
            "--out",
            str(out),
            "--tokens",
            "3",
            "--precisions",
            "bf16,fp8,int8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())
    rows = {(r["precision"], r["batch"]): r for r in table["rows"]}
    assert len(rows) == 9 and table["machine"]["cores"] >= 1
    for batch in (1, 8, 64):
        bf16 = rows["bf16", batch]
        # 28 layers of about 50 kernels: a count that lost the decoder would be far less
        assert 28 * 20 < bf16["kernels_per_step"] == bf16["kernels_per_step_unfused"]
        for precision in ("fp8", "int8"):
            row = rows[precision, batch]
            # 196 linears, each one kernel fused and more than two before
            assert row["kernels_per_step"] <= bf16["kernels_per_step"]
            assert row["kernels_per_step_unfused"] >= row["kernels_per_step"] + 196
            assert row["top_ops"]["linear_8bit"] == 196
            assert row["predicted_h100_ms"] < row["predicted_h100_ms_unfused"]
    # the fit reproduces the cell it was fitted on
    fitted = rows["bf16", 1]
    assert fitted["predicted_h100_ms"] == pytest.approx(fitted["measured_h100_ms_unfused"])
    assert (
        "--tokens must be at least 2"
        in subprocess.run(
            [sys.executable, str(REPO / "bench" / "decode_steps.py"), "--tokens", "1"],
            capture_output=True,
            text=True,
        ).stderr
    )
