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


def test_the_generated_code_s_launches_are_counted_by_kind():
    from bench.decode_steps_compiled import step_code_launches

    code = """
def call(args):
    arg0_1, = args
    assert_size_stride(arg0_1, (1, 4), (4, 1))
    buf0 = empty_strided_cpu((1, 4), (4, 1), torch.float32)
    cpp_fused_add_mul_0(arg0_1, buf0)
    buf1 = extern_kernels.mm(buf0, arg1_1)
    extern_kernels.addmm(arg2_1, buf1, arg3_1, alpha=1, beta=1, out=buf2)
    buf3 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf2, buf2, buf2)
    cpp_fused_rsqrt_1(buf3)
    return (reinterpret_tensor(buf3, (1, 4), (4, 1), 0), )
"""
    launches = step_code_launches(code)
    assert launches == {
        "fused": 2,
        "extern_kernels.mm": 1,
        "extern_kernels.addmm": 1,
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default": 1,
    }


@pytest.mark.slow
def test_the_compiled_step_is_counted_from_inductors_code(tmp_path):
    """Two layers, BF16, batch 1: every linear of the model is one GEMM launch of the
    compiled step (7 a layer and the LM head), the rest fused kernels and attention, and
    the step with what runs outside it launches fewer kernels than the eager step."""
    out = tmp_path / "compiled.json"
    command = [sys.executable, str(REPO / "bench" / "decode_steps_compiled.py"), "--out", str(out)]
    command += ["--layers", "2", "--precisions", "bf16", "--batches", "1", "--tokens", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    kinds = row["launches_by_kind"]
    gemms = sum(n for kind, n in kinds.items() if kind.startswith("extern_kernels."))
    assert gemms == 7 * 2 + 1, kinds
    assert kinds["fused"] >= 2 and row["kernels_in_step"] == sum(kinds.values())
    eager = subprocess.run(
        [sys.executable, "-c", EAGER_COUNT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert row["kernels_per_step"] < float(eager.stdout.split()[-1])


EAGER_COUNT = """
import sys, torch
sys.path.insert(0, "bench")
from decode_steps import SHAPE, count_step
from rollout import gpu_engine
engine = gpu_engine("bf16", torch.device("cpu"), SHAPE | {"num_hidden_layers": 2}, eager=True)
print(count_step(engine, 1, 3, True)[0])
"""
