"""SmoothQuant-style calibration profile for INT8 rollouts, computed once, reused
every version (FlashRL's profile step, without a second pre-quantized model).

For each norm → linear-layers group of a Llama-family decoder layer
(input_layernorm → q/k/v_proj, post_attention_layernorm → gate/up_proj), input
channel j gets s_j = max|X_j|^α / max|W_·j|^(1−α) from activations on task prompts.
The INT8 policy multiplies those layers' weight columns by s and divides the norm's
weight by s: the float model computes the same function, but the activations the
layers see are divided by s, so their outliers shrink before per-token INT8 rounding.

    python -m asyncfp8.precision.profile --model DIR --task arithmetic --out profile.safetensors
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SMOOTHED_GROUPS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.(input_layernorm|post_attention_layernorm)$")


@torch.no_grad()
def compute_profile(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], alpha: float = 0.5
) -> dict[str, torch.Tensor]:
    """{tensor name: per-input-channel factors} for every norm and linear it smooths."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    modules = dict(model.named_modules())
    groups = {}
    for name in modules:
        match = _LAYER.match(name)
        if match:
            linears = [f"{match.group(1)}.{suffix}" for suffix in SMOOTHED_GROUPS[match.group(2)]]
            if all(n in modules for n in linears):
                groups[name] = linears
    if not groups:
        raise ValueError(
            "no Llama-family norm -> linear groups (input_layernorm, post_attention_layernorm) found"
        )

    act_max: dict[str, torch.Tensor] = {}
    hooks = []
    for norm_name in groups:

        def record(_module, _inputs, output, key=norm_name):
            flat = output.detach().abs().float().reshape(-1, output.shape[-1]).amax(0)
            act_max[key] = torch.maximum(act_max[key], flat) if key in act_max else flat

        hooks.append(modules[norm_name].register_forward_hook(record))
    try:
        model.eval()
        for batch in batches:
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()

    profile = {}
    for norm_name, linears in groups.items():
        weight_max = torch.stack(
            [modules[n].weight.detach().abs().float().amax(0) for n in linears]
        ).amax(0)
        factors = (
            act_max[norm_name].clamp_min(1e-5).pow(alpha)
            / weight_max.clamp_min(1e-5).pow(1 - alpha)
        ).clamp_min(1e-5)
        profile[f"{norm_name}.weight"] = factors
        for name in linears:
            profile[f"{name}.weight"] = factors.clone()
    return profile


def save_profile(profile: dict[str, torch.Tensor], path: str | Path, **metadata: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in profile.items()},
        path,
        metadata={k: str(v) for k, v in metadata.items()},
    )
    return path


def load_profile(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"INT8 calibration profile {str(path)!r} does not exist; make one with "
            "`python -m asyncfp8.precision.profile --model DIR --task arithmetic --out FILE`"
        )
    profile = load_file(path)
    bad = [
        name
        for name, t in profile.items()
        if t.dim() != 1 or not torch.isfinite(t).all() or (t <= 0).any()
    ]
    if bad:
        raise ValueError(f"{path}: factors must be finite, positive 1-D tensors; bad: {bad[:3]}")
    return profile


def main(argv: list[str] | None = None) -> None:
    from asyncfp8.models import load_model, load_tokenizer
    from asyncfp8.tasks import get_task

    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.precision.profile", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument(
        "--task", default="arithmetic", help="task whose prompts calibrate the activations"
    )
    parser.add_argument("--out", required=True, help="output .safetensors file")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="migration strength (SmoothQuant's α)"
    )
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    task = get_task(args.task)
    texts = [task.prompt(i).text for i in range(args.samples)]
    batches = [
        dict(tokenizer(texts[i : i + args.batch_size], return_tensors="pt", padding=True))
        for i in range(0, len(texts), args.batch_size)
    ]
    profile = compute_profile(model, batches, args.alpha)
    path = save_profile(
        profile, args.out, model=args.model, task=args.task, samples=args.samples, alpha=args.alpha
    )
    spread = torch.cat([v for k, v in profile.items() if "norm" in k])
    print(
        f"wrote {path}: {len(profile)} tensors, factors {spread.min().item():.3g}..{spread.max().item():.3g}"
    )


if __name__ == "__main__":
    main()
