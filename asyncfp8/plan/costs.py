"""What one forward step does, counted: FLOPs and bytes per primitive, no hardware.

Per layer four GEMMs, attention over every sequence's KV cache and elementwise work, then
the LM head and the logits; with tensor parallelism each GPU's share (docs/plan.md, "The
model"). `step.py` prices them; tests/test_plan.py checks them by hand and by trace."""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelFacts
from .precisions import Precision

ACTIVATION_BYTES = 2  # activations, logits inputs and unquantized weights: BF16 by default
LOGIT_BYTES = 4  # logits are materialized in fp32 for sampling and logprobs
LOGIT_PASSES = 3  # written once, read by the softmax (logprobs), read by the sampler


@dataclass(frozen=True)
class Op:
    """One primitive of a step, summed over the layers it occurs in, on one GPU."""

    name: str
    kind: str  # "gemm", "attention" or "memory"
    flops: float
    weight_bytes: float  # weights read (at the precision's storage size, scales included)
    io_bytes: float  # everything else read or written: activations, KV cache, logits
    dtype: str  # what the math runs in: bf16, fp8, int8 (GEMMs) or the KV type (attention)
    launches: float = 0  # GEMM kernels this op stands for in one step (a share: mixed)
    experts_reached: float = 0  # routed experts: those a step reaches, summed over layers


def kv_bytes_per_token(model: ModelFacts, precision: Precision) -> int:
    """KV-cache bytes one token takes over all layers (whole engine, any tp)."""
    return 2 * model.num_layers * model.kv_size * precision.kv_bytes_per_element


def _layer_linear_bytes(model: ModelFacts, precision: Precision, moe: bool) -> tuple[int, int]:
    """(bytes of the attention linears, bytes of the MLP or of one expert) of one layer,
    quantized where the precision quantizes; the shared expert counts with attention
    because every token reads it."""
    shapes = model.linear_shapes(moe)
    attention = sum(precision.linear_bytes(n, k) for _, n, k in shapes[:4])
    if not moe:
        return attention, sum(precision.linear_bytes(n, k) for _, n, k in shapes[4:])
    expert = sum(
        precision.linear_bytes(n, k) for name, n, k in shapes if name.startswith("experts.0.")
    )
    shared = sum(
        precision.linear_bytes(n, k) for name, n, k in shapes if name.startswith("shared_expert.")
    )
    return attention + shared, expert


def weight_bytes(model: ModelFacts, precision: Precision) -> float:
    """Bytes of the whole model as the engine holds it: quantized linears with their
    scales, embeddings, LM head, norms, biases and routers in the engine's dtype."""
    total = model.embedding_params() * precision.activation_bytes
    for moe, layers in ((False, model.dense_layers), (True, model.moe_layers)):
        if layers:
            attention, mlp = _layer_linear_bytes(model, precision, moe)
            experts = model.num_experts if moe else 1
            unquantized = model.unquantized_layer_params(moe) * precision.activation_bytes
            total += layers * (attention + experts * mlp + unquantized)
    return total


def distinct_experts(model: ModelFacts, tokens: int) -> float:
    """Expected number of experts a layer reads for `tokens` tokens, each routed to k of
    E experts uniformly at random: E (1 - (1 - k/E)^tokens). Real routers are skewed,
    which touches fewer experts at large batch; uniform is the cautious side."""
    e, k = model.num_experts, model.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** tokens)


def decode_ops(
    model: ModelFacts, precision: Precision, batch: int, context_tokens: float, tp: int = 1
) -> list[Op]:
    """The primitives of one decode step of `batch` sequences whose KV caches hold
    `context_tokens` tokens in all (the new token included), on one of `tp` GPUs. A
    mixed layout's GEMMs are two ops each: its quantized share in the format, the rest
    in BF16 (FLOPs, bytes and kernel launches split alike)."""
    share = precision.quantized_share
    if share == 1:
        return _decode_ops(model, precision, batch, context_tokens, tp)
    whole = Precision(precision.name, precision.storage)
    quantized = _decode_ops(model, whole, batch, context_tokens, tp)
    plain = _decode_ops(model, precision.unquantized(), batch, context_tokens, tp)
    ops = []
    for q, b in zip(quantized, plain, strict=True):
        if q.kind != "gemm" or q.dtype == b.dtype:
            ops.append(q)
            continue
        ops += [_scaled(q, share), _scaled(b, 1 - share)]
    return ops


def _scaled(op: Op, share: float) -> Op:
    return Op(
        op.name,
        op.kind,
        op.flops * share,
        op.weight_bytes * share,
        op.io_bytes * share,
        op.dtype,
        op.launches * share,
        op.experts_reached * share,
    )


def _decode_ops(
    model: ModelFacts, precision: Precision, batch: int, context_tokens: float, tp: int = 1
) -> list[Op]:
    b, h = batch, model.hidden_size
    weights, act = precision.weights, precision.activation_bytes
    ops: list[Op] = []

    def gemm(name: str, layers: int, out_features: int, in_features: int, wbytes: float):
        ops.append(
            Op(
                name,
                "gemm",
                flops=layers * 2.0 * b * out_features * in_features / tp,
                weight_bytes=layers * wbytes / tp,
                io_bytes=layers * b * (in_features + out_features / tp) * act,
                dtype=weights,
                launches=layers,
            )
        )

    for moe, layers in ((False, model.dense_layers), (True, model.moe_layers)):
        if not layers:
            continue
        shapes = model.linear_shapes(moe)
        qkv_out = model.q_size + 2 * model.kv_size
        qkv_bytes = sum(precision.linear_bytes(n, k) for _, n, k in shapes[:3])
        gemm("qkv_proj", layers, qkv_out, h, qkv_bytes)
        gemm("o_proj", layers, h, model.q_size, precision.linear_bytes(h, model.q_size))
        if not moe:
            i = model.intermediate_size
            gemm("gate_up_proj", layers, 2 * i, h, 2 * precision.linear_bytes(i, h))
            gemm("down_proj", layers, h, i, precision.linear_bytes(h, i))
            continue
        ops += _expert_ops(model, precision, b, layers, tp)
        if model.shared_expert_intermediate_size:
            s = model.shared_expert_intermediate_size
            gemm("shared_gate_up", layers, 2 * s, h, 2 * precision.linear_bytes(s, h))
            gemm("shared_down", layers, h, s, precision.linear_bytes(h, s))

    ops += _per_token_ops(model, precision, b, context_tokens, tp)
    return ops


def _expert_ops(model: ModelFacts, precision: Precision, b: int, layers: int, tp: int) -> list[Op]:
    """A decode step's router and routed-expert GEMMs over `layers` MoE layers."""
    h, act = model.hidden_size, precision.activation_bytes
    weights = precision.weights
    ops: list[Op] = []
    ops.append(
        Op(
            "router",
            "gemm",
            flops=layers * 2.0 * b * model.num_experts * h,
            weight_bytes=layers * model.num_experts * h * act,
            io_bytes=layers * b * (h + model.num_experts) * act,
            dtype="bf16",
            launches=layers,
        )
    )
    i, k = model.moe_intermediate_size, model.experts_per_token
    touched = distinct_experts(model, b)
    expert_bytes = 2 * precision.linear_bytes(i, h) + precision.linear_bytes(h, i)
    ops.append(
        Op(
            "experts",
            "gemm",
            flops=layers * 2.0 * b * k * 3 * i * h / tp,
            weight_bytes=layers * touched * expert_bytes / tp,
            io_bytes=layers * b * k * (2 * h + 3 * i / tp) * act,
            dtype=weights,
            launches=2 * layers,  # grouped gate/up, then grouped down
            experts_reached=layers * touched,
        )
    )
    return ops


def _per_token_ops(
    model: ModelFacts, precision: Precision, b: int, context_tokens: float, tp: int
) -> list[Op]:
    """A decode step's attention, elementwise work, LM head and logits."""
    h, act = model.hidden_size, precision.activation_bytes
    ops: list[Op] = []
    kv_heads_per_gpu = -(-model.num_kv_heads // tp)
    layers = model.num_layers
    ops.append(
        Op(
            "attention",
            "attention",
            # q·K over the context, then the weights times V: 2 FLOPs per multiply-add each
            flops=layers * 4.0 * model.num_heads * model.head_dim * context_tokens / tp,
            weight_bytes=0.0,
            io_bytes=layers
            * context_tokens
            * 2
            * kv_heads_per_gpu
            * model.head_dim
            * precision.kv_bytes_per_element,
            dtype=precision.kv,
        )
    )
    mlp_width = (
        model.experts_per_token * model.moe_intermediate_size
        + model.shared_expert_intermediate_size
        if model.is_moe
        else model.intermediate_size
    )
    # Per token and layer: two RMSNorms and two residual adds over the hidden state (read
    # twice, written once each), rotary on q and k, SiLU-and-multiply over the MLP width.
    elementwise = 12 * h + (4 * (model.q_size + model.kv_size) + 6 * mlp_width) / tp
    scaled = elementwise * act / ACTIVATION_BYTES  # counted in BF16 bytes
    ops.append(Op("elementwise", "memory", 0.0, 0.0, layers * b * scaled, "bf16"))
    ops.append(
        Op(
            "lm_head",
            "gemm",
            flops=2.0 * b * model.vocab_size * h / tp,
            weight_bytes=model.vocab_size * h * act / tp,
            io_bytes=b * (h + model.vocab_size / tp) * act,
            dtype="bf16",
            launches=1,
        )
    )
    logits = b * model.vocab_size / tp * LOGIT_BYTES * LOGIT_PASSES
    ops.append(Op("logits", "memory", 0.0, 0.0, logits, "bf16"))
    return ops


def step_flops(ops: list[Op]) -> float:
    return sum(op.flops for op in ops)


def step_bytes(ops: list[Op]) -> float:
    return sum(op.weight_bytes + op.io_bytes for op in ops)


def prefill_flops(model: ModelFacts, prompt_tokens: int) -> float:
    """FLOPs of prefilling one prompt (logits of its last token only, as engines do):
    every linear over every token, causal attention over the growing prefix."""
    linear_params = model.active_parameter_count() - model.embedding_params()
    gemm = 2.0 * prompt_tokens * linear_params + 2.0 * model.vocab_size * model.hidden_size
    attention = 2.0 * model.num_layers * model.q_size * prompt_tokens * (prompt_tokens + 1)
    return gemm + attention
