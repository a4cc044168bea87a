"""bench/plan_moe.py: the planner's price of an MoE decode table measured on the CPU, by
the calibration fitted to dense cells, beside that calibration's stated error; and the
planner's MoE estimate naming its priors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # the stated error refits the dense calibration once per cell
def test_an_moe_table_is_priced_beside_the_stated_error(tmp_path, monkeypatch, capsys):
    from bench import plan_moe

    rows = [
        {"engine": "torch", "precision": p, "context": c, "batch": b, "decode_tokens_per_s": 100.0}
        for p in ("bf16", "fp8")
        for c, b in (("short", 1), ("long", 64))
    ]
    rows.append({"engine": "vllm", "precision": "bf16", "context": "short", "batch": 1})
    table = {"rows": rows, "new_tokens": 32, "long_prompt": 384}
    (tmp_path / "t.json").write_text(json.dumps(table))
    out = tmp_path / "plan.json"
    argv = ["plan_moe.py", "--table", str(tmp_path / "t.json"), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert plan_moe.main() == 0
    result = json.loads(out.read_text())
    assert [c["label"] for c in result["cells"]] == [
        f"torch {p} {c} batch {b}" for p in ("bf16", "fp8") for c, b in (("short", 1), ("long", 64))
    ]
    assert all(c["predicted_tokens_per_s"] > 0 for c in result["cells"])
    assert 0 < result["stated_median_abs_error_held_out"] < 1
    assert "stated error (held out on the dense cells)" in capsys.readouterr().out


def test_the_moe_gpu_estimate_names_its_priors():
    from omegaconf import OmegaConf

    import asyncfp8
    from asyncfp8.plan.planner import make_plan
    from asyncfp8.plan.report import table

    cfg = OmegaConf.load(Path(asyncfp8.__file__).parent / "conf" / "plan.yaml")
    cfg.model.path = "qwen3-30b-a3b"
    text = table(make_plan(OmegaConf.to_container(cfg, resolve=True)))
    assert "MoE: the routed experts are priced as dense linears" in text
    assert "none: all priors" in text  # no GPU has measured a vLLM engine
    cfg.model.path = "qwen3-8b"
    assert "MoE:" not in table(make_plan(OmegaConf.to_container(cfg, resolve=True)))


def test_an_engine_that_loops_over_the_experts_pays_each_experts_kernels():
    """With `expert_loop_kernels` the experts' GEMM launches are the reached experts times
    the loop's kernels, not two grouped kernels a layer: the step costs exactly the extra
    launches more, and a dense model is priced as before."""
    from dataclasses import replace

    from asyncfp8.plan.costs import decode_ops, distinct_experts
    from asyncfp8.plan.gpus import GPUS
    from asyncfp8.plan.model import load_model_facts
    from asyncfp8.plan.precisions import get_precision
    from asyncfp8.plan.step import Efficiency, price_ops

    gpu, fp8 = GPUS["h100"], get_precision("fp8")
    grouped = Efficiency()
    looped = replace(grouped, expert_loop_kernels={"bf16": 2.0, "fp8": 3.0, "int8": 3.0})
    for batch in (1, 64):
        moe = load_model_facts("small_moe")
        ops = decode_ops(moe, fp8, batch, batch * 40.0)
        extra = price_ops(ops, moe, fp8, gpu, looped, batch).seconds
        extra -= price_ops(ops, moe, fp8, gpu, grouped, batch).seconds
        reached = moe.moe_layers * distinct_experts(moe, batch)
        expected = (3 * reached - 2 * moe.moe_layers) * grouped.gemm_launch_s["fp8"]
        assert abs(extra - expected) < 1e-12
        dense = load_model_facts("small")
        ops = decode_ops(dense, fp8, batch, batch * 40.0)
        assert price_ops(ops, dense, fp8, gpu, looped, batch).seconds == pytest.approx(
            price_ops(ops, dense, fp8, gpu, grouped, batch).seconds
        )
