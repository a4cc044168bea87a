"""SmoothQuant-style calibration profile for INT8 rollouts, computed once, reused
every version (FlashRL's profile step, without a second pre-quantized model).

For each norm → linear-layers group of a Llama-family decoder layer
(input_layernorm → q/k/v_proj, post_attention_layernorm → gate/up_proj), input
channel j gets s_j = max|X_j|^α / max|W_·j|^(1−α) from activations on task prompts.
The INT8 policy multiplies those layers' weight columns by s and divides the norm's
weight by s: the float model computes the same function, but the activations the
layers see are divided by s, so their outliers shrink before per-token INT8 rounding.

The two linear layers whose input is another linear layer's output, channel for channel,
are smoothed the same way through that layer (FOLDED): down_proj's input is
act(gate) · up_proj's output, so dividing up_proj's output channels (its weight's rows)
by s divides down_proj's input by s; o_proj's input is attention's weighted sum of
v_proj's outputs, so dividing v_proj's rows and bias by s divides it by s, each of a kv
head's channels shared by the query heads of its group (GQA: one factor per v channel,
the largest activation over the group). Both are exact in float. down_proj's input is
where a decoder's activation outliers sit, and on `small` the layers a mixed INT8 layout
keeps in BF16 are mostly down_proj and v_proj (docs/precision.md).

    python -m asyncfp8.precision.profile --model DIR --task arithmetic --out profile.safetensors
"""

from __future__ import annotations

import argparse
import re

import torch

from .profile_file import ROWS, save_profile

SMOOTHED_GROUPS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.(input_layernorm|post_attention_layernorm)$")
# consumer -> producer: the consumer's input channels are the producer's output channels
FOLDED = {"mlp.down_proj": "mlp.up_proj", "self_attn.o_proj": "self_attn.v_proj"}


@torch.no_grad()
def compute_profile(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    alpha: float = 0.5,
    fold: bool = True,
) -> dict[str, torch.Tensor]:
    """{tensor name: per-channel factors}: a norm's weight and a producer's bias are
    divided by theirs, a linear weight's columns multiplied, and a producer's rows (its
    weight's name + ROWS) divided. `fold`: also smooth FOLDED's consumers."""
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
    folds = _folds(modules) if fold else {}

    act_max: dict[str, torch.Tensor] = {}

    def record(key: str, x: torch.Tensor) -> None:
        flat = x.detach().abs().float().reshape(-1, x.shape[-1]).amax(0)
        act_max[key] = torch.maximum(act_max[key], flat) if key in act_max else flat

    hooks = [
        modules[norm].register_forward_hook(lambda _m, _i, out, key=norm: record(key, out))
        for norm in groups
    ] + [
        modules[consumer].register_forward_pre_hook(
            lambda _m, args, key=consumer: record(key, args[0])
        )
        for consumer in folds
    ]
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
        factors = _factors(act_max[norm_name], weight_max, alpha)
        profile[f"{norm_name}.weight"] = factors
        for name in linears:
            profile[f"{name}.weight"] = factors.clone()
    heads, kv_heads = _heads(model)
    for consumer, producer in folds.items():
        acts = act_max[consumer]
        weights = modules[consumer].weight.detach().abs().float().amax(0)
        shared = producer.endswith("v_proj") and heads != kv_heads
        if shared:  # a v channel feeds heads // kv_heads query heads' channels of o_proj
            acts, weights = (_per_kv_channel(t, heads, kv_heads) for t in (acts, weights))
        factors = _factors(acts, weights, alpha)
        profile[f"{producer}.weight{ROWS}"] = factors
        if getattr(modules[producer], "bias", None) is not None:
            profile[f"{producer}.bias"] = factors.clone()
        profile[f"{consumer}.weight"] = (
            _to_query_channels(factors, heads, kv_heads) if shared else factors.clone()
        )
    return profile


def _factors(acts: torch.Tensor, weights: torch.Tensor, alpha: float) -> torch.Tensor:
    return (acts.clamp_min(1e-5).pow(alpha) / weights.clamp_min(1e-5).pow(1 - alpha)).clamp_min(
        1e-5
    )


def _folds(modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """{consumer: producer} of every FOLDED pair the model has, as module names."""
    folds = {}
    for name in modules:
        for consumer, producer in FOLDED.items():
            if name.endswith("." + consumer):
                other = name.removesuffix(consumer) + producer
                if other in modules:
                    folds[name] = other
    return folds


def _heads(model: torch.nn.Module) -> tuple[int, int]:
    config = model.config
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _per_kv_channel(per_query: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """o_proj's input channels (query head h = kv · group + r, then the head's dims, as
    transformers' repeat_kv lays them out) to v_proj's output channels: the largest over
    each kv head's group."""
    return per_query.reshape(kv_heads, heads // kv_heads, -1).amax(1).reshape(-1)


def _to_query_channels(per_kv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    group = heads // kv_heads
    return per_kv.reshape(kv_heads, 1, -1).expand(kv_heads, group, -1).reshape(-1).clone()


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
    parser.add_argument(
        "--no-fold",
        action="store_true",
        help="smooth only the layers after a norm, not down_proj and o_proj",
    )
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    task = get_task(args.task)
    texts = [task.prompt(i).text for i in range(args.samples)]
    batches = [
        dict(tokenizer(texts[i : i + args.batch_size], return_tensors="pt", padding=True))
        for i in range(0, len(texts), args.batch_size)
    ]
    profile = compute_profile(model, batches, args.alpha, fold=not args.no_fold)
    path = save_profile(
        profile,
        args.out,
        model=args.model,
        task=args.task,
        samples=args.samples,
        alpha=args.alpha,
        fold=not args.no_fold,
    )
    spread = torch.cat([v for k, v in profile.items() if "norm" in k])
    print(
        f"wrote {path}: {len(profile)} tensors, factors {spread.min().item():.3g}..{spread.max().item():.3g}"
    )


if __name__ == "__main__":
    main()
