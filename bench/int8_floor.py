"""Where INT8 W8A8's mismatch comes from: its weights' rounding or its activations'
(issue 46's goal: at least 80% of the linear FLOPs quantized at no more than 1.3x BF16's
mismatch). For a model, the exact KL(engine || FP32 learner) on the planner's calibration
texts (asyncfp8/precision/sensitivity.py, the measure `precision=mixed` budgets), as a
multiple of BF16's, with INT8 on every linear layer the policy quantizes and on the
layout that quantizes 80% of their FLOPs (the planner's `quantized_share=0.8`), each
three ways:

- W8A8: the torch engine's runtime module (`Int8Linear`), as a run computes it;
- weights only: the per-channel INT8 weight, dequantized, in a BF16 linear layer;
- activations only: the BF16 weight, its input rounded per token to INT8 and back.

W8A8 (fake): both roundings in torch, the check that the two parts make up the runtime
module's mismatch (it should sit near the W8A8 row). If the weights alone already exceed
the goal's 1.3x on a layout, no treatment of the activations (SmoothQuant's α, a per-layer
α) reaches it with per-channel INT8 weights.

    python bench/int8_floor.py [--model small] [--share 0.8] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_json
from torch import nn

from asyncfp8.precision.int8.quant import (
    dequantize_per_channel,
    quantize_activations_int8,
    quantize_per_channel_reference,
)


class WeightOnly(nn.Module):
    """A BF16 linear layer whose weight is the per-channel INT8 rounding of the master."""

    def __init__(self, master: torch.Tensor, plain: nn.Linear):
        super().__init__()
        q, scale = quantize_per_channel_reference(master)
        self.weight = nn.Parameter(
            dequantize_per_channel(q, scale).to(plain.weight.dtype), requires_grad=False
        )
        self.bias = plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RoundedInput(nn.Module):
    """`inner` on its input rounded per token to INT8 and back (in the input's dtype)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_activations_int8(rows)
        return self.inner((q.float() * scale).to(x.dtype).reshape(x.shape))


def measure(model_name: str, share: float, prompts: int) -> dict:
    from hydra import compose, initialize_config_module

    import asyncfp8.conf  # noqa: F401  (the config schemas, before Hydra composes)
    from asyncfp8.models import load_model, load_tokenizer, run_model_dir
    from asyncfp8.precision.registry import build_policy
    from asyncfp8.precision.sensitivity import (
        EngineTwin,
        calibration_batch,
        mean_kl,
        mixed_part,
        plan_layout,
    )
    from asyncfp8.tasks import build_task

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("sensitivity", overrides=[f"model={model_name}", "precision.base=int8"])
    model_dir = run_model_dir(cfg)
    base = mixed_part(build_policy(cfg.precision, model_dir)).base
    model = load_model(model_dir, dtype=torch.float32).eval()
    task, tokenizer = build_task(cfg.task, model_dir), load_tokenizer(model_dir)
    batch, mask = calibration_batch(task, tokenizer, prompts)
    layout = plan_layout(model, base, batch, mask, quantized_share=share)

    twin = EngineTwin(model, base)
    masters = {name.removesuffix(".weight"): p.detach() for name, p in model.named_parameters()}
    with torch.no_grad():
        learner = model(**batch).logits.float()
    runtime = {name: switch.fake_quant for name, switch in twin.switches.items()}
    ways = {
        "W8A8": runtime,
        "weights only": {
            name: WeightOnly(masters[name], switch.plain) for name, switch in twin.switches.items()
        },
        "activations only": {
            name: RoundedInput(switch.plain) for name, switch in twin.switches.items()
        },
    }
    ways["W8A8 (fake)"] = {name: RoundedInput(m) for name, m in ways["weights only"].items()}
    floor = mean_kl(twin.logits(batch, set()), learner, mask)
    flops = twin.flops()
    total = sum(flops.values())
    layouts = {
        "every layer": set(twin.switches),
        f"{layout.quantized_share:.0%} of the FLOPs": set(twin.switches) - set(layout.keep),
    }
    rows = []
    for way, modules in ways.items():
        for name, switch in twin.switches.items():
            switch.fake_quant = modules[name]
        for where, quantized in layouts.items():
            kl = mean_kl(twin.logits(batch, quantized), learner, mask)
            rows.append(
                {
                    "rounding": way,
                    "layout": where,
                    "share": sum(flops[n] for n in quantized) / total,
                    "kl": kl,
                    "x_bf16": kl / floor,
                }
            )
    return {"model": model_name, "prompts": prompts, "bf16_kl": floor, "keep": layout.keep} | {
        "rows": rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--share", type=float, default=0.8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--out", default="bench/results/int8-floor-small.json")
    args = parser.parse_args()
    started = time.perf_counter()
    result = measure(args.model, args.share, args.prompts)
    result["seconds"] = time.perf_counter() - started
    print(f"BF16's KL on {args.prompts} calibration texts: {result['bf16_kl']:.3e}")
    print("| INT8 rounding | layout | linear FLOPs quantized | KL | x BF16 |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        print(
            f"| {row['rounding']} | {row['layout']} | {row['share']:.0%} | {row['kl']:.3e} "
            f"| {row['x_bf16']:.2f}x |"
        )
    print(f"written: {write_json(args.out, result)} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
