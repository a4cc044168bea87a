"""An MoE layer's experts as one grouped GEMM per projection, as vLLM's fused MoE runs them:
the (token, k) pairs sorted by expert and padded to whole row blocks on the device (static
shapes, no host sync, so a CUDA graph captures it), then one Triton kernel in which each
program multiplies a block of rows by its expert's weight, 16-bit or blockwise e4m3 with
the activations quantized inside (the dense fused kernel's arithmetic, fp8/fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from .experts import ExpertLinears, fused_experts
from .fp8 import FP8BlockLinear, fused_fp8_takes
from .kernel_support import (
    DeviceFacts,
    ceil_div,
    triton,
    triton_runs_on,
    unavailable,
    why_no_triton,
)

#: Rows of (token, k) pairs per program: decode batches route few pairs to each expert.
BLOCK_M = 16

if triton is not None:
    import triton.language as tl

    from .kernel_support import round_to_e4m3_grid

    @triton.jit
    def _grouped_kernel(
        x_ptr,
        w_ptr,
        w_scale_ptr,
        out_ptr,
        rows_ptr,
        block_expert_ptr,
        route_weight_ptr,
        pairs,
        N,
        K,
        top_k,
        group_n,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_om,
        TOKEN_ROWS: tl.constexpr,
        WEIGHTED: tl.constexpr,
        FP8: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # A row block holds one expert's pairs (align_routes pads each expert's to whole
        # blocks); a block past the last expert's has expert -1 and writes nothing.
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert >= 0:
            pair = tl.load(rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
            valid = pair < pairs
            # The first projection reads each pair's token's row; the last, the pair's own.
            source = pair // top_k if TOKEN_ROWS else pair
            rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            n_in = rn < N
            x_rows = x_ptr + source[:, None].to(tl.int64) * stride_xm
            w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn
            w_scales = w_scale_ptr + expert.to(tl.int64) * stride_se + (rn // group_n) * stride_sn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for tile in range(0, tl.cdiv(K, BLOCK_K)):
                k = tile * BLOCK_K + rk
                k_in = k < K
                x = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_in[None, :], other=0.0)
                b = tl.load(w_cols + k[:, None], mask=k_in[:, None] & n_in[None, :], other=0.0)
                if FP8:  # a K tile is one activation group: the dense fused kernel's steps
                    x = x.to(tl.float32)
                    a_scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), 448.0)
                    a = round_to_e4m3_grid(tl.clamp(tl.div_rn(x, a_scale[:, None]), -448.0, 448.0))
                    a = a.to(tl.float8e4nv)
                    if UPCAST:  # no FP8 MMA before sm89; e4m3 -> fp16 is exact
                        a = a.to(tl.float16)
                        b = b.to(tl.float16)
                    b_scale = tl.load(w_scales + tile, mask=n_in, other=0.0)
                    acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
                elif IEEE:  # FP32 operands (FP32 weights, or 16-bit ones under the
                    # interpreter, whose 16-bit dot returns garbage): no TF32 rounding
                    acc += tl.dot(x.to(tl.float32), b.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x.to(b.dtype), b)
            if WEIGHTED:  # the router's weight of the pair, in the last projection
                route_weight = tl.load(route_weight_ptr + pair, mask=valid, other=0.0)
                acc *= route_weight.to(tl.float32)[:, None]
            out = out_ptr + pair[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])


def align_routes(top_k_index: torch.Tensor, experts: int, block_m: int = BLOCK_M):
    """(rows, block_expert) for the pairs of `top_k_index` [tokens, k]: `rows` [capacity]
    int32 holds each sorted row's pair index (token·k + j; `pairs` on padding), every
    expert's rows padded to whole blocks of `block_m`; `block_expert` [capacity / block_m]
    int32 names each block's expert (-1 past the last). capacity = pairs + experts·(block_m
    − 1), rounded up to whole blocks: it depends on shapes only."""
    flat = top_k_index.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would sync for its size
    padded = ceil_div_tensor(counts, block_m) * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    rank = torch.arange(pairs, device=flat.device) - firsts[sorted_experts]
    capacity = ceil_div(pairs + experts * (block_m - 1), block_m) * block_m
    rows = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    rows[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def ceil_div_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


def grouped_matmul(
    x: torch.Tensor,
    routes: tuple[torch.Tensor, torch.Tensor],
    weight: torch.Tensor,
    top_k: int,
    out_features: int,
    *,
    token_rows: bool,
    weight_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    route_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    device: DeviceFacts | None = None,
) -> torch.Tensor:
    """out [pairs, out_features]: each (token, k) pair's row times its expert's weight.
    `x` [tokens, K] (`token_rows`: every pair of a token reads its row) or [pairs, K];
    `weight` [experts, ≥ N, ≥ K], 16-bit, or float8_e4m3fn with `weight_scale` [experts,
    N / block[0], K / block[1]] fp32; `route_weights` [pairs] scale each pair's row."""
    if not triton_runs_on(x):
        raise unavailable("grouped_matmul", x, why_no_triton(x), "the expert loop (ExpertLinears)")
    rows, block_expert = routes
    pairs = x.shape[0] * top_k if token_rows else x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((pairs, out_features), dtype=out_dtype or x.dtype, device=x.device)
    if pairs == 0:
        return out
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 and (weight_scale is None or block is None):
        raise ValueError("grouped_matmul: FP8 weights need weight_scale and block")
    device = device or DeviceFacts.of(x)
    block_n = 64 if device.cuda else 32  # the interpreter runs tiles element by element
    grid = (block_expert.numel(), ceil_div(out_features, block_n))
    scale = weight_scale if fp8 else out  # not read without FP8
    _grouped_kernel[grid](
        x,
        weight,
        scale,
        out,
        rows,
        block_expert,
        route_weights if route_weights is not None else out,  # not read unless WEIGHTED
        pairs,
        out_features,
        x.shape[1],
        top_k,
        block[0] if fp8 else 1,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        scale.stride(0) if fp8 else 0,
        scale.stride(1) if fp8 else 0,
        out.stride(0),
        TOKEN_ROWS=token_rows,
        WEIGHTED=route_weights is not None,
        FP8=fp8,
        IEEE=weight.dtype == torch.float32 or not device.cuda,
        UPCAST=fp8 and not device.fp8_mma,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block[1] if fp8 else 64,
    )
    return out


def summed_pairs(out: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[pairs, H] fp32 -> [tokens, H]: each token's k expert outputs summed, then rounded."""
    return out.view(tokens, top_k, -1).sum(1).to(dtype)


class GroupedExperts(nn.Module):
    """transformers' fused 16-bit experts (`gate_up_proj` [E, 2·I, H], `down_proj` [E, H,
    I]; the same parameters, so the same names) run as two grouped GEMMs."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = fused.gate_up_proj, fused.down_proj
        self.act_fn = fused.act_fn
        self.device_facts = DeviceFacts.of(self.gate_up_proj)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        experts, double_i, _ = self.gate_up_proj.shape
        tokens, top_k = top_k_index.shape
        routes = align_routes(top_k_index, experts)
        facts = self.device_facts
        gate_up = grouped_matmul(
            hidden_states, routes, self.gate_up_proj, top_k, double_i, token_rows=True, device=facts
        )
        half = double_i // 2
        hidden = self.act_fn(gate_up[:, :half]) * gate_up[:, half:]
        down = grouped_matmul(
            hidden,
            routes,
            self.down_proj,
            top_k,
            self.down_proj.shape[1],
            token_rows=False,
            route_weights=top_k_weights.reshape(-1),
            out_dtype=torch.float32,
            device=facts,
        )
        return summed_pairs(down, tokens, top_k, hidden_states.dtype)


class StackedFP8Experts:
    """The blockwise-FP8 expert linears of one ExpertLinears as three grouped GEMMs: each
    projection's e4m3 weights and scales stacked [E, ...], every expert's FP8BlockLinear
    left reading its own slice (a view), so that a version's `load` writes the stack."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, experts: nn.ModuleList):
        self.stacks = {}
        for projection in self.PROJECTIONS:
            modules = [getattr(expert, projection) for expert in experts]
            q = torch.stack([m.q for m in modules])
            scale = torch.stack([m.scale_inv for m in modules])
            for e, module in enumerate(modules):
                module._buffers["q"], module._buffers["scale_inv"] = q[e], scale[e]
            self.stacks[projection] = (q, scale, modules[0].out_features)
        self.block = experts[0].gate_proj.block
        self.act_fn = experts[0].act_fn
        self.device_facts = DeviceFacts.of(experts[0].gate_proj.q)

    def _projection(self, name, x, routes, top_k, token_rows, **kw) -> torch.Tensor:
        q, scale, out_features = self.stacks[name]
        return grouped_matmul(
            x,
            routes,
            q,
            top_k,
            out_features,
            token_rows=token_rows,
            weight_scale=scale,
            block=self.block,
            device=self.device_facts,
            **kw,
        )

    def __call__(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        routes = align_routes(top_k_index, self.stacks["gate_proj"][0].shape[0])
        gate = self._projection("gate_proj", hidden_states, routes, top_k, True)
        up = self._projection("up_proj", hidden_states, routes, top_k, True)
        down = self._projection(
            "down_proj",
            self.act_fn(gate) * up,
            routes,
            top_k,
            False,
            route_weights=top_k_weights.reshape(-1),
            out_dtype=torch.float32,
        )
        return summed_pairs(down, tokens, top_k, hidden_states.dtype)


def _stackable(experts: nn.ModuleList) -> bool:
    linears = [getattr(e, p) for e in experts for p in StackedFP8Experts.PROJECTIONS]
    return all(
        isinstance(m, FP8BlockLinear)
        and m.real
        and m.bias is None
        and fused_fp8_takes(m.block) is None
        and m.block == linears[0].block
        and triton_runs_on(m.q)
        for m in linears
    )


def group_experts(model: nn.Module) -> list[str]:
    """Where Triton runs on the model's device: each fused 16-bit experts module replaced
    by GroupedExperts, each all-FP8 ExpertLinears given its StackedFP8Experts. Returns the
    names of the experts modules left to a loop over the experts (INT8, a user's format;
    every one where Triton does not run), which a CUDA graph cannot capture."""
    looped = []
    for name, module in fused_experts(model):
        if triton_runs_on(module.gate_up_proj):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, GroupedExperts(module))
        else:
            looped.append(name)
    for name, module in model.named_modules():
        if isinstance(module, ExpertLinears):
            if _stackable(module):
                module.grouped = StackedFP8Experts(module)
            else:
                looped.append(name)
    return looped
