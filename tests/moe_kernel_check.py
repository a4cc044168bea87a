"""Run under TRITON_INTERPRET=1 (tests/test_moe_grouped.py does, in a subprocess): the grouped
expert GEMMs (asyncfp8/precision/grouped_experts.py) against the loops they replace, transformers'
Qwen3MoeExperts for 16-bit experts and the engine's ExpertLinears of FP8BlockLinear for
blockwise FP8, at batch 1, odd sizes and more tokens than a row block.

    TRITON_INTERPRET=1 python tests/moe_kernel_check.py

Prints one line per mismatch and `<n> cases checked, <m> mismatches, worst <ratio>`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from asyncfp8.precision.experts import ExpertLinears
from asyncfp8.precision.fp8 import FP8BlockLinear, quantize_blockwise_reference
from asyncfp8.precision.grouped_experts import GroupedExperts, StackedFP8Experts, group_experts
from tests.engine_kernel_check import Report

# (tokens, experts, top_k, hidden, moe intermediate)
CASES = [(1, 4, 2, 64, 32), (5, 8, 2, 96, 48), (37, 16, 4, 128, 80), (3, 4, 4, 200, 64)]


def experts_module(experts: int, hidden: int, intermediate: int, generator: torch.Generator):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts
    )
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return module


def routing(tokens: int, experts: int, top_k: int, generator: torch.Generator):
    logits = torch.randn(tokens, experts, generator=generator)
    weights, index = torch.softmax(logits, -1).topk(top_k, -1)
    return index, weights / weights.sum(-1, keepdim=True)


def check_16bit(report: Report, generator: torch.Generator) -> None:
    # FP32: the same products summed in another order (per tile, then over the k pairs);
    # BF16: transformers rounds each expert's output to BF16 and adds them in BF16, the
    # grouped path sums the k pairs in FP32 and rounds once: up to about k + 2 BF16 ulps
    # (2^-8 of the largest output each) apart.
    for tokens, experts, top_k, hidden, intermediate in CASES:
        fused = experts_module(experts, hidden, intermediate, generator)
        x = torch.randn(tokens, hidden, generator=generator)
        index, weights = routing(tokens, experts, top_k, generator)
        for dtype, relative in ((torch.float32, 1e-5), (torch.bfloat16, (top_k + 2) * 2**-8)):
            module = fused.to(dtype)
            with torch.no_grad():
                expected = module(x.to(dtype), index, weights.to(dtype)).float()
                got = GroupedExperts(module)(x.to(dtype), index, weights.to(dtype)).float()
            allowed = relative * expected.abs().amax().clamp_min(1e-6)
            label = f"grouped {dtype} tokens {tokens} experts {experts} top-{top_k} H {hidden}"
            report.within(label, (got - expected).abs(), allowed.expand_as(got))


def fp8_expert_linears(fused) -> ExpertLinears:
    """The engine's module for `fused` under the fp8 policy: each expert linear an
    FP8BlockLinear from the reference quantizer, as apply_policy builds it."""
    experts = ExpertLinears(fused)
    for expert in experts:
        for name in StackedFP8Experts.PROJECTIONS:
            weight = getattr(expert, name).weight.detach()
            q, scale = quantize_blockwise_reference(weight)
            setattr(expert, name, FP8BlockLinear(name, q, scale, None))
    return experts


def check_fp8(report: Report, generator: torch.Generator) -> None:
    # The grouped kernel's arithmetic is the dense fused kernel's, row by row; the loop
    # runs each expert's unfused FP8 layer (a quantizer, the block GEMM): the fused check's
    # tolerance (engine_kernel_check.check_fused_modules), through two projections.
    for tokens, experts, top_k, hidden, intermediate in CASES:
        fused = experts_module(experts, hidden, intermediate, generator)
        module = fp8_expert_linears(fused)
        x = torch.randn(tokens, hidden, generator=generator)
        index, weights = routing(tokens, experts, top_k, generator)
        with torch.no_grad():
            expected = module(x, index, weights)
            module.grouped = StackedFP8Experts(module)
            got = module(x, index, weights)
        allowed = 1e-5 * expected.abs().amax().clamp_min(1e-6)
        label = f"grouped fp8 tokens {tokens} experts {experts} top-{top_k} H {hidden}"
        report.within(label, (got - expected).abs(), allowed.expand_as(got))
        # A version loaded into one expert's layer lands in the stack the kernel reads.
        layer = module[experts - 1].down_proj
        q, scale = quantize_blockwise_reference(torch.randn(hidden, intermediate) * 0.3)
        layer.load({"down_proj": q, "down_proj_scale_inv": scale})
        with torch.no_grad():
            grouped = module(x, index, weights)
            module.grouped = None
            looped = module(x, index, weights)
        report.within(f"{label} after a load", (grouped - looped).abs(), allowed.expand_as(got))


def check_group_experts(report: Report, generator: torch.Generator) -> None:
    # group_experts takes the FP8 ExpertLinears and leaves any other (INT8) to the loop.
    from asyncfp8.precision.int8 import Int8Linear, quantize_per_channel_reference

    fused = experts_module(4, 64, 32, generator)
    model = torch.nn.ModuleDict({"fp8": fp8_expert_linears(fused), "int8": ExpertLinears(fused)})
    for expert in model["int8"]:
        for name in StackedFP8Experts.PROJECTIONS:
            q, scale = quantize_per_channel_reference(getattr(expert, name).weight.detach())
            setattr(expert, name, Int8Linear(name, q, scale, None))
    looped = group_experts(model)
    report.exact("group_experts", looped == ["int8"] and model["fp8"].grouped is not None)


def check_engine(report: Report, generator: torch.Generator) -> None:
    # The torch engine on the shipped tiny_moe with the grouped kernels (Triton on) and
    # with the loops (ASYNCFP8_TRITON=0), before and after a version, in FP32 (in BF16 a
    # rounding moves a router's near-tie or an activation's e4m3 step): the same log-probs.
    import os

    from asyncfp8.engines.torch_engine import TorchEngine
    from asyncfp8.models import load_model, make_tiny_model
    from asyncfp8.precision import get_policy, version_weights

    model_dir = make_tiny_model("tiny_moe", progress=False)
    masters = load_model(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in masters.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    ids = torch.randint(3, 60, (3, 12), generator=generator)
    for precision in ("bf16", "fp8"):
        logps = []
        for triton_on in ("1", "0"):
            os.environ["ASYNCFP8_TRITON"] = triton_on
            policy = get_policy(precision)
            policy.engine_dtype = torch.float32  # only the summation order differs
            engine = TorchEngine(str(model_dir), policy, device="cpu", dtype=torch.float32)
            experts = engine.model.model.layers[0].mlp.experts
            grouped = isinstance(experts, GroupedExperts) or getattr(experts, "grouped", None)
            report.exact(
                f"engine {precision} grouped={triton_on}", bool(grouped) == (triton_on == "1")
            )
            runs = []
            for version in (0, 1):
                if version:
                    engine.update_weights(
                        1, dict(version_weights(policy, masters.named_parameters()))
                    )
                with torch.no_grad():
                    runs.append(torch.log_softmax(engine.model(ids).logits.float(), -1))
            logps.append(runs)
        os.environ["ASYNCFP8_TRITON"] = "1"
        for version in (0, 1):
            grouped, looped = logps[0][version], logps[1][version]
            allowed = torch.full_like(grouped, 1e-4)
            report.within(
                f"engine {precision} version {version}", (grouped - looped).abs(), allowed
            )


def main() -> int:
    report = Report()
    for check in (check_16bit, check_fp8, check_group_experts, check_engine):
        check(report, torch.Generator().manual_seed(0))
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
