"""bench/rollout.py: `--device cuda` without a GPU says so and exits non-zero; the CPU
table's rows and ratios; the GPU table's loop (build, quantize, time the engine's decode
loop, the bandwidth floor) run on the CPU at a small shape. Durations are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_bench(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "rollout.py"), *args],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_gpu_table_without_a_gpu_says_so_and_exits_non_zero(tmp_path):
    out = tmp_path / "rollout.json"
    result = run_bench("--device", "cuda", "--out", str(out), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "found no CUDA GPU" in result.stderr and "Nothing was measured" in result.stderr
    assert not out.exists()


def import_bench():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import rollout
    finally:
        sys.path.remove(str(REPO / "bench"))
    return rollout


@pytest.mark.slow
def test_the_cpu_table_runs_the_torch_engine(tiny_model_dir, monkeypatch):
    # The engines really generate (and the bench checks how many tokens); the durations
    # are replaced by made-up ones, so that the table, not this machine's speed, is tested.
    rollout = import_bench()
    real_timed = rollout.timed

    def timed(engine, prompt, batch, new_tokens, repeats):
        real_timed(engine, prompt, batch, new_tokens, 1)
        return 1e-3 * batch * new_tokens * (2 if engine.policy.name == "int8" else 1)

    monkeypatch.setattr(rollout, "timed", timed)
    args = Namespace(model=str(tiny_model_dir), engines="torch", precisions=["bf16", "int8"])
    args.new_tokens, args.long, args.repeats = 4, 40, 1
    table = rollout.cpu_table(args)
    rows = table["rows"]
    assert [(r["precision"], r["context"], r["batch"]) for r in rows] == [
        (p, c, b) for p in ("bf16", "int8") for c in ("short", "long") for b in (1, 64)
    ]
    for row in rows:
        # batch × 3 decode tokens over (4 - 1) ms per sequence (twice that for int8)
        expected = 1000 if row["precision"] == "bf16" else 500
        assert row["tokens_per_s"] == pytest.approx(expected)
        assert row["ratio_to_bf16"] == pytest.approx(expected / 1000)
        assert row["long_context"] == (row["context"] == "long")
    assert table["long_prompt"] == 40 and table["new_tokens"] == 4


def test_the_gpu_table_loop_on_the_cpu_at_a_small_shape(monkeypatch):
    rollout = import_bench()
    small = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    monkeypatch.setitem(rollout.__dict__, "QWEN_1_5B", {**rollout.QWEN_1_5B, **small})
    args = Namespace(new_tokens=4, short=8, long=40, precisions=["bf16", "fp8+fp8_kv"])
    args.repeats, args.eager = 1, True
    bandwidth = 1e10
    table = rollout.gpu_table(args, torch.device("cpu"), bandwidth)
    rows = table["rows"]
    # batch 1, 8 and 64 after the short prompt, 1 and 64 after the long one
    cells = [(8, 1), (8, 8), (8, 64), (40, 1), (40, 64)]
    assert [(r["precision"], r["prompt_tokens"], r["batch"]) for r in rows] == [
        (p, c, b) for p in ("bf16", "fp8+fp8_kv") for c, b in cells
    ]
    bf16, fp8 = rows[4], rows[9]  # long context, batch 64
    # The floor by hand: bf16 weights (the tied embedding once, as the LM head) plus the
    # KV cache at the mean context, 2 layers × k and v × 2 KV heads × 32 dims.
    weights = _model_bytes(small)
    kv = 64 * (40 + 4 / 2) * 2 * 2 * 2 * 32
    assert bf16["weight_bytes_per_step"] == weights
    assert bf16["kv_bytes_per_step"] == kv * 2 and fp8["kv_bytes_per_step"] == kv
    assert bf16["floor_tokens_per_s"] == pytest.approx(64 * bandwidth / (weights + 2 * kv))
    assert fp8["weight_bytes_per_step"] < 0.8 * weights  # 8-bit linears
    for row in rows:
        assert row["fraction_of_floor"] == pytest.approx(
            row["tokens_per_s"] / row["floor_tokens_per_s"]
        )
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 3 / row["decode_s"])
    assert fp8["ratio_to_bf16"] == pytest.approx(fp8["tokens_per_s"] / bf16["tokens_per_s"])


def _model_bytes(shape):
    """Parameters (the tied embedding once) in bf16, plus the buffers (RoPE frequencies)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(p.numel() for p in model.parameters()) * 2 + buffers


def test_a_failing_precision_or_row_leaves_the_others_and_each_row_is_saved_at_once(
    tmp_path, monkeypatch
):
    """The GPU table on the CPU at the toy shape, with one precision failing to build and
    one row failing: every other row is measured, the failures are rows with an `error`,
    and the JSON on disk is rewritten after every row (a step stopped at its time limit
    keeps what it measured)."""
    rollout = import_bench()
    out = tmp_path / "rollout.json"
    on_disk = []  # rows in the file after each write
    real_save, real_engine, real_row = rollout.Table.save, rollout.gpu_engine, rollout.gpu_row

    def save(table):
        path = real_save(table)
        on_disk.append(len(json.loads(path.read_text())["rows"]))
        return path

    def engine(precision, *args):
        if precision == "fp8":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return real_engine(precision, *args)

    def row(engine, device, prompt_tokens, batch, *args):
        if engine.policy.name == "bf16" and (prompt_tokens, batch) == (40, 64):
            raise RuntimeError("CUDA out of memory")
        return real_row(engine, device, prompt_tokens, batch, *args)

    monkeypatch.setattr(rollout.Table, "save", save)
    monkeypatch.setattr(rollout, "gpu_engine", engine)
    monkeypatch.setattr(rollout, "gpu_row", row)
    args = Namespace(new_tokens=3, short=8, long=40, precisions=["bf16", "fp8", "int8"])
    args.repeats, args.eager, args.shape = 1, True, rollout.TOY
    table = rollout.gpu_table(args, torch.device("cpu"), 1e10, out)
    rows = table["rows"]
    cells = [(8, 1), (8, 8), (8, 64), (40, 1), (40, 64)]
    assert [(r["precision"], r.get("prompt_tokens"), r.get("batch")) for r in rows] == [
        *(("bf16", c, b) for c, b in cells),
        ("fp8", None, None),
        *(("int8", c, b) for c, b in cells),
    ]
    failed = [r for r in rows if "error" in r]
    assert [r["error"] for r in failed] == [
        "RuntimeError: CUDA out of memory",
        "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED",
    ]
    measured = [r for r in rows if "error" not in r]
    assert len(measured) == 9 and all(r["tokens_per_s"] > 0 for r in measured)
    # int8's ratio where BF16 has a row, None where BF16's row failed
    ratios = {(r["prompt_tokens"], r["batch"]): r["ratio_to_bf16"] for r in rows[-5:]}
    assert ratios[(40, 64)] is None and all(v > 0 for k, v in ratios.items() if k != (40, 64))
    assert on_disk == list(range(len(rows) + 1))  # written at the start and after each row
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


@pytest.mark.slow
def test_the_profile_of_a_decode_step_runs_each_case_on_the_cpu(tmp_path, monkeypatch):
    """bench/rollout_profile.py --dry-run: each toy case built, timed and profiled; on a
    CPU there are no device kernels, so the step is all host time."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import rollout_profile

    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["rollout_profile.py", "--dry-run", "--out", str(out)])
    assert rollout_profile.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["precision"], r["batch"]) for r in rows] == [
        (p, b) for p, _, b in rollout_profile.TOY_CASES
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["wall_ms"] > 0 and row["gpu_ms"] == 0 and row["kernels"] == []


def test_the_colocated_bench_reads_a_runs_rate_held_out_and_released_memory(tmp_path, monkeypatch):
    """bench/colocated.py's row from a finished run's files (the launches themselves are
    the colocated tests'; its dry run takes three of them)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import colocated

    summary = {"samples_per_s": 50.0, "elapsed_s": 30.0, "steps": 10, "guard_rollbacks": 0}
    summary |= {"eval_pass1_greedy_start": 0.3, "eval_pass1_greedy_end": 0.9}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    records = [{"step": 1}, {"step": 2, "worker/colocated/memory/released_gib": 1.5}]
    records.append({"step": 3, "worker/colocated/memory/released_gib": 2.5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    row = colocated.read_run(tmp_path)
    assert row["trained_samples_per_s"] == 50.0 and row["seconds_per_step"] == 3.0
    assert (row["heldout_greedy_start"], row["heldout_greedy_end"]) == (0.3, 0.9)
    assert row["released_gib_per_turn"] == 2.0  # the mean over the turns that released
    monkeypatch.setattr(sys, "argv", ["colocated.py", "--modes", "async,nonsense"])
    with pytest.raises(SystemExit):
        colocated.main()
