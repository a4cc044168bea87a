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
