"""SmoothQuant-style calibration profile for INT8 rollouts, computed once, reused
every version (FlashRL's profile step, without a second pre-quantized model).

The factors, the folds and `--alpha auto`: docs/precision.md, "INT8 and the SmoothQuant profile".
    python -m asyncfp8.precision.profile --model DIR --task arithmetic --out profile.safetensors
"""

from __future__ import annotations

import argparse
import re

import torch

from .int8.quant import (
    dequantize_per_channel,
    quantize_activations_int8,
    quantize_per_channel_reference,
)
from .profile_file import ROWS, save_profile

SMOOTHED_GROUPS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.(input_layernorm|post_attention_layernorm)$")
# consumer -> producer: the consumer's input channels are the producer's output channels
FOLDED = {"mlp.down_proj": "mlp.up_proj", "self_attn.o_proj": "self_attn.v_proj"}
ALPHA_GRID = tuple(i / 10 for i in range(10))  # `alpha="auto"`: 0.0, 0.1, ..., 0.9
ROWS_KEPT = 4096  # activation rows of each input `alpha="auto"` judges on


@torch.no_grad()
def compute_profile(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    alpha: float | str = 0.5,
    fold: bool = True,
    chosen: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """{tensor name: per-channel factors}: a norm's weight and a producer's bias are
    divided by theirs, a linear weight's columns multiplied, and a producer's rows (its
    weight's name + ROWS) divided. `fold`: also smooth FOLDED's consumers. `alpha`: one
    for every group, or "auto" (each group's from ALPHA_GRID; `chosen` receives them by
    the norm's or the consumer's name)."""
    search = alpha == "auto"
    if not search and not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1] or 'auto', got {alpha!r}")
    modules = dict(model.named_modules())
    groups = _norm_groups(modules)
    folds = _folds(modules) if fold else {}
    act_max, act_rows = _activations(model, batches, modules, groups, folds, search)

    profile = {}
    for norm_name, linears in groups.items():
        weight_max = torch.stack(
            [modules[n].weight.detach().abs().float().amax(0) for n in linears]
        ).amax(0)
        weights = [modules[n].weight.detach().float() for n in linears]

        def group_factors(a: float, norm_name=norm_name, weight_max=weight_max) -> torch.Tensor:
            return _factors(act_max[norm_name], weight_max, a)

        factors = (
            _best_alpha(group_factors, act_rows[norm_name], weights, norm_name, chosen)
            if search
            else group_factors(alpha)
        )
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

        def fold_factors(a: float, acts=acts, weights=weights) -> torch.Tensor:
            return _factors(acts, weights, a)

        def on_consumer(factors: torch.Tensor, shared=shared) -> torch.Tensor:
            return _to_query_channels(factors, heads, kv_heads) if shared else factors

        if search:
            factors = _best_alpha(
                fold_factors,
                act_rows[consumer],
                [modules[consumer].weight.detach().float()],
                consumer,
                chosen,
                on_consumer,
            )
        else:
            factors = fold_factors(alpha)
        profile[f"{producer}.weight{ROWS}"] = factors
        if getattr(modules[producer], "bias", None) is not None:
            profile[f"{producer}.bias"] = factors.clone()
        profile[f"{consumer}.weight"] = on_consumer(factors).clone()
    return profile


def _norm_groups(modules: dict[str, torch.nn.Module]) -> dict[str, list[str]]:
    """{norm: the linear layers it feeds} of every SMOOTHED_GROUPS group the model has."""
    groups = {}
    for name in modules:
        match = _LAYER.match(name)
        if match:
            linears = [f"{match.group(1)}.{suffix}" for suffix in SMOOTHED_GROUPS[match.group(2)]]
            if all(n in modules for n in linears):
                groups[name] = linears
    if not groups:
        raise ValueError(
            "no Llama-family norm -> linear groups (input_layernorm, post_attention_layernorm) "
            "found"
        )
    return groups


def _activations(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    modules: dict[str, torch.nn.Module],
    groups: dict[str, list[str]],
    folds: dict[str, str],
    search: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Runs `batches` through `model`: (the largest |input| per channel of each group's
    linears, by norm, and of each fold's consumer; with `search`, up to ROWS_KEPT of those
    input rows, padding left out, to judge α on)."""
    act_max: dict[str, torch.Tensor] = {}
    act_rows: dict[str, list[torch.Tensor]] = {}  # alpha="auto": inputs to judge on

    real: list[torch.Tensor | None] = [None]  # the batch's token positions (not padding)

    def record(key: str, x: torch.Tensor) -> None:
        rows = x.detach().float().reshape(-1, x.shape[-1])
        flat = rows.abs().amax(0)
        act_max[key] = torch.maximum(act_max[key], flat) if key in act_max else flat
        if not search:
            return
        have = sum(len(r) for r in act_rows.get(key, []))
        if have < ROWS_KEPT:
            if real[0] is not None and real[0].numel() == len(rows):
                rows = rows[real[0]]  # judged on tokens, not on the padding
            act_rows.setdefault(key, []).append(rows[: ROWS_KEPT - have].clone())

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
            mask = batch.get("attention_mask")
            real[0] = None if mask is None else mask.reshape(-1).bool()
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return act_max, act_rows


def _best_alpha(
    factors_at,
    rows: list[torch.Tensor],
    weights: list[torch.Tensor],
    key: str,
    chosen: dict[str, float] | None,
    on_weights=lambda factors: factors,
) -> torch.Tensor:
    """The factors of the α in ALPHA_GRID whose W8A8 products of the inputs `rows` with
    `weights` (columns multiplied by `on_weights(factors)`) err least from the float's."""
    x = torch.cat(rows)[:ROWS_KEPT]
    exact = [x @ w.T for w in weights]
    errors = {}
    for a in ALPHA_GRID:
        s = on_weights(factors_at(a))
        errors[a] = sum(
            float((_w8a8(x / s, w * s) - y).pow(2).sum())
            for w, y in zip(weights, exact, strict=True)
        )
    best = min(errors, key=errors.get)
    if chosen is not None:
        chosen[key] = best
    return factors_at(best)


def _w8a8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x wᵀ with x rounded per row (token) and w per row (output channel) to INT8, as the
    INT8 policy rounds them, in FP32."""
    xq, xs = quantize_activations_int8(x)
    wq, ws = quantize_per_channel_reference(w)
    return dequantize_per_channel(xq, xs) @ dequantize_per_channel(wq, ws).T


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
    from asyncfp8.hf.loading import load_model, load_tokenizer
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
        "--alpha",
        type=_alpha_arg,
        default=0.5,
        help="migration strength (SmoothQuant's α), or 'auto': each group's, searched",
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
    chosen: dict[str, float] = {}
    profile = compute_profile(model, batches, args.alpha, fold=not args.no_fold, chosen=chosen)
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
        f"wrote {path}: {len(profile)} tensors, "
        f"factors {spread.min().item():.3g}..{spread.max().item():.3g}"
    )
    if chosen:
        print("α per group: " + ", ".join(f"{k} {a:.1f}" for k, a in chosen.items()))


def _alpha_arg(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number in [0, 1] or 'auto', got {text!r}") from None


if __name__ == "__main__":
    main()
