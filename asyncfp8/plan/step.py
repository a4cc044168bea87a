"""The price of a forward step on a GPU: a roofline per primitive, corrected by measured
efficiency, plus fixed per-kernel, per-layer and per-step costs (AIConfigurator's
decomposition, priced by speed-of-light formulas; docs/plan.md, "The model", "Price").
The efficiency factors come from a calibration (calibration.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .costs import Op, decode_ops, kv_bytes_per_token, prefill_flops, weight_bytes
from .gpus import GPU
from .model import ModelFacts
from .precisions import Precision

DTYPES = ("bf16", "fp8", "int8")
KV_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks reached, and fixed costs, per primitive."""

    memory: float = 0.9  # elementwise work and logits, fraction of memory bandwidth
    gemm_memory: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(DTYPES, 0.9)
    )  # streaming a GEMM's weights, per weight type
    gemm_compute: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DTYPES, 0.7))
    attention_memory: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(KV_DTYPES, 0.9)
    )  # reading the KV cache, per KV type
    attention_compute: float = 0.5
    layer_overhead_s: float = 10e-6  # the kernels of a layer that are not GEMMs
    gemm_launch_s: dict[str, float] = field(
        default_factory=lambda: {"bf16": 2.5e-6, "fp8": 5e-6, "int8": 5e-6}
    )  # fixed cost per GEMM kernel, by input type
    expert_loop_kernels: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(DTYPES, 0.0)
    )  # GEMM kernels per reached expert where the engine loops over them (0: grouped)
    kv_quantize_overhead_s: float = 0.0
    step_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    link: float = 0.8  # fraction of the GPU-GPU link bandwidth an all-reduce reaches


@dataclass(frozen=True)
class StepPrice:
    seconds: float
    by_primitive: dict[str, float]  # seconds per op name, and the fixed costs


def price_ops(
    ops: list[Op],
    model: ModelFacts,
    precision: Precision,
    gpu: GPU,
    eff: Efficiency,
    batch: int,
    tp: int = 1,
) -> StepPrice:
    parts: dict[str, float] = {}
    bandwidth = gpu.bandwidth
    launches = 0.0
    for op in ops:
        if op.kind == "gemm":
            compute = op.flops / (gpu.peak_flops(op.dtype) * eff.gemm_compute[op.dtype])
            memory = (op.weight_bytes + op.io_bytes) / (bandwidth * eff.gemm_memory[op.dtype])
            seconds = max(compute, memory)
            # No tensor cores for the type: weight-only (W8A16), no activation quantization.
            kernel = op.dtype if gpu.has_tensor_cores_for(op.dtype) else "bf16"
            per_expert = eff.expert_loop_kernels.get(kernel, 0.0) if op.experts_reached else 0
            count = op.experts_reached * per_expert if per_expert else op.launches
            launches += count * eff.gemm_launch_s[kernel]
        elif op.kind == "attention":
            compute = op.flops / (gpu.peak_flops("bf16") * eff.attention_compute)
            seconds = max(compute, op.io_bytes / (bandwidth * eff.attention_memory[op.dtype]))
        else:
            seconds = op.io_bytes / (bandwidth * eff.memory)
        parts[op.name] = parts.get(op.name, 0.0) + seconds
    parts["gemm_launches"] = launches
    parts["layer_overhead"] = model.num_layers * eff.layer_overhead_s
    if precision.kv == "fp8":
        parts["kv_quantize_overhead"] = model.num_layers * eff.kv_quantize_overhead_s
    parts["step_overhead"] = eff.step_overhead_s
    if tp > 1:
        message = batch * model.hidden_size * precision.activation_bytes
        per_allreduce = eff.allreduce_latency_s + 2 * (tp - 1) / tp * message / (
            gpu.link_gb_s * 1e9 * eff.link
        )
        parts["allreduce"] = (2 * model.num_layers + 1) * per_allreduce
    return StepPrice(sum(parts.values()), parts)


def decode_step(
    model: ModelFacts,
    precision: Precision,
    gpu: GPU,
    eff: Efficiency,
    batch: int,
    context_tokens: float,
    tp: int = 1,
) -> StepPrice:
    """Seconds of one decode step of `batch` sequences holding `context_tokens` KV
    tokens in all, on an engine of `tp` GPUs."""
    ops = decode_ops(model, precision, batch, context_tokens, tp)
    return price_ops(ops, model, precision, gpu, eff, batch, tp)


def prefill_seconds(
    model: ModelFacts, precision: Precision, gpu: GPU, eff: Efficiency, tokens: int, tp: int = 1
) -> float:
    """Compute time of prefilling `tokens` prompt tokens; engines chunk prefills into
    the decode steps, whose weight reads they share, so only the FLOPs are added."""
    dtype = precision.weights if gpu.has_tensor_cores_for(precision.weights) else "bf16"
    share = precision.quantized_share  # a mixed layout: the rest at the BF16 rate

    def rate(kind: str) -> float:
        return tp * gpu.peak_flops(kind) * eff.gemm_compute[kind]

    return prefill_flops(model, tokens) * (share / rate(dtype) + (1 - share) / rate("bf16"))


def kv_capacity_tokens(
    model: ModelFacts,
    precision: Precision,
    gpu: GPU,
    tp: int = 1,
    memory_utilization: float = 0.9,
    reserved_gib: float = 2.0,
) -> int:
    """Tokens the KV cache holds on an engine of `tp` GPUs: each GPU gives
    `memory_utilization` of its memory, less its share of the weights and `reserved_gib`
    (activations of the engine's profiling run, CUDA graphs, NCCL and cuBLAS workspaces),
    to its share of the KV heads (never less than one head: vLLM replicates them)."""
    kv_heads_per_gpu = -(-model.num_kv_heads // tp)
    per_token_per_gpu = kv_bytes_per_token(model, precision) * kv_heads_per_gpu / model.num_kv_heads
    free = gpu.memory_bytes * memory_utilization - weight_bytes(model, precision) / tp
    free -= reserved_gib * 2**30
    return max(0, int(free // per_token_per_gpu))


class StepModel:
    """`decode_step` and `prefill_seconds` for the many calls of a rollout simulation:
    everything but attention depends on the batch only and is priced once per batch;
    attention is linear in the context (both sides of its roofline)."""

    def __init__(
        self, model: ModelFacts, precision: Precision, gpu: GPU, eff: Efficiency, tp: int = 1
    ):
        self.args = (model, precision, gpu, eff)
        self.tp = tp
        per_token = next(
            op for op in decode_ops(model, precision, 1, 1.0, tp) if op.kind == "attention"
        )
        self.attention_compute_s = per_token.flops / (
            gpu.peak_flops("bf16") * eff.attention_compute
        )
        self.attention_memory_s = per_token.io_bytes / (
            gpu.bandwidth * eff.attention_memory[precision.kv]
        )
        self._without_attention: dict[int, float] = {}
        self._prefill: dict[int, float] = {}

    def seconds(self, batch: int, context_tokens: float) -> float:
        fixed = self._without_attention.get(batch)
        if fixed is None:
            fixed = decode_step(*self.args, batch, 0.0, self.tp).seconds
            self._without_attention[batch] = fixed
        return fixed + context_tokens * max(self.attention_compute_s, self.attention_memory_s)

    def prefill_seconds(self, tokens: int) -> float:
        seconds = self._prefill.get(tokens)
        if seconds is None:
            seconds = prefill_seconds(*self.args, tokens, self.tp)
            self._prefill[tokens] = seconds
        return seconds
