"""The layout of `precision=mixed`, measured on a run's model: which linear layers stay in
BF16 (asyncfp8.precision.sensitivity says how). The launcher measures it before any process
starts; on its own it prints each layer's sensitivity and the override that starts with it:

    python -m asyncfp8.plan.layout model=small precision.base=int8 precision.budget=1.3
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncfp8.hf.loading import load_model, load_tokenizer
from asyncfp8.precision.registry import build_policy
from asyncfp8.precision.sensitivity import (
    Layout,
    keep_override,
    mixed_part,
    plan_for,
    unmeasured_mixed,
)
from asyncfp8.tasks import build_task


def measure_for_run(cfg, model_dir, run_dir) -> Layout | None:
    """The launcher's step before any process starts: with precision=mixed and no
    precision.keep, the layout measured on the model the run starts from (and written to
    `run_dir/precision_layout.json`); None when there is nothing to measure."""
    mixed = unmeasured_mixed(build_policy(cfg.precision, model_dir))
    if mixed is None:
        return None
    if mixed.budget is not None:
        rule = f"within {mixed.budget}x BF16's KL"
    elif mixed.budget_kl is not None:
        rule = f"within a KL of {mixed.budget_kl:.2e}"
    else:
        rule = f"quantizing {mixed.quantized_share:.0%} of the linear FLOPs"
    print(
        f"[launch] precision=mixed: measuring each linear layer's {mixed.base.name} mismatch on "
        f"{mixed.calibration_prompts} calibration prompts ({rule})",
        flush=True,
    )
    model = load_model(model_dir, dtype=torch.float32).eval()
    layout = plan_for(mixed, model, build_task(cfg.task, model_dir), load_tokenizer(model_dir))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "precision_layout.json").write_text(layout.to_json())
    print(f"[launch] precision=mixed: {layout.summary()}", flush=True)
    return layout


def main() -> None:
    import hydra

    import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)

    @hydra.main(version_base="1.3", config_path="../conf", config_name="sensitivity")
    def run(cfg) -> None:
        from asyncfp8.models import run_model_dir

        model_dir = run_model_dir(cfg)
        policy = build_policy(cfg.precision, model_dir)
        weights = mixed_part(policy)
        if weights is None:
            raise SystemExit(f"precision must be mixed (precision=mixed), got {policy.name!r}")
        model = load_model(model_dir, dtype=torch.float32).eval()
        layout = plan_for(
            weights,
            model,
            build_task(cfg.task, model_dir),
            load_tokenizer(model_dir),
            progress=lambda text: print(f"[sensitivity] {text}", flush=True),
        )
        print("| layer | KL added alone | share of FLOPs | kept in BF16 |")
        print("|---|---|---|---|")
        total = sum(layout.flops.values())
        for name in sorted(layout.sensitivity, key=layout.sensitivity.get, reverse=True):
            print(
                f"| {name} | {layout.sensitivity[name]:.2e} | {layout.flops[name] / total:.1%} "
                f"| {'yes' if name in layout.keep else ''} |"
            )
        print(f"[sensitivity] {weights.base.name}: {layout.summary()}")
        print(f"[sensitivity] start every process with: {keep_override(layout)}")
        if cfg.out:
            with open(cfg.out, "w") as out:
                out.write(layout.to_json())
            print(f"[sensitivity] written: {cfg.out}")

    run()


if __name__ == "__main__":
    main()
