"""Decode attention over an FP8 (e4m3) KV cache, reading the cache as e4m3.

One new query token per sequence against a static e4m3 cache: a Triton kernel (CUDA, or the
CPU under `TRITON_INTERPRET=1`) keeping an online softmax in fp32, or the torch reference.
How the kernel works, and why scales and lengths are tensors: docs/precision.md, "Kernels".
"""

from __future__ import annotations

import math

import torch

from ..kernel_support import (
    ceil_div,
    check_impl,
    multiprocessors,
    next_power_of_2,
    triton,
    triton_runs_on,
    unavailable,
    why_no_triton,
)

FP8 = torch.float8_e4m3fn
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The torch reference also takes float64 queries (and then computes in float64).
REFERENCE_QUERY_DTYPES = (*QUERY_DTYPES, torch.float64)
LOG2E = 1.4426950408889634

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_query_group(q_row, heads, d, g_in, d_in, stride_qh):
        """The query heads of one KV head's group, in fp32, padded to a tl.dot tile (>= 16
        rows)."""
        return tl.load(
            q_row + heads[:, None] * stride_qh + d[None, :],
            mask=g_in[:, None] & d_in[None, :],
            other=0.0,
        ).to(tl.float32)

    @triton.jit
    def _online_softmax_step(
        q, k, v, valid, qk_scale, running_max, running_sum, acc, PRECISION: tl.constexpr
    ):
        """One tile of e4m3 keys and values folded into the online softmax (scores in log2
        units, invalid positions -inf): the new running max, running sum and accumulator."""
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # Until a row has seen a valid position its max is -inf; subtract 0 then,
        # so that exp2(-inf - (-inf)) never makes a NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - shift)
        p = tl.exp2(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(p, 1)
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        acc = acc * correction[:, None] + pv
        return new_max, running_sum, acc

    @triton.jit
    def _normalised(acc, running_sum, v_scale_ptr):
        """The accumulator over the softmax's sum, times the v scale. A sequence with no
        valid position attends to nothing: its output is 0."""
        denominator = tl.where(running_sum > 0.0, running_sum, 1.0)
        return acc / denominator[:, None] * tl.load(v_scale_ptr)

    @triton.jit
    def _fp8_kv_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        k_scale_ptr,
        v_scale_ptr,
        valid_ptr,
        len_ptr,
        out_ptr,
        max_ptr,
        sum_ptr,
        sm_scale,
        t_max,
        tiles_per_split,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_valid_b,
        stride_len,
        stride_ob,
        stride_oh,
        stride_os,
        stride_mb,
        stride_mh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        HAS_LEN: tl.constexpr,
        SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        g_in = g < GROUP
        d_in = d < HEAD_DIM
        q = _load_query_group(q_ptr + b * stride_qb, heads, d, g_in, d_in, stride_qh)
        # Scores in log2 units: exp2 is the cheap exponential.
        qk_scale = sm_scale * tl.load(k_scale_ptr) * 1.4426950408889634
        limit = t_max
        if HAS_LEN:
            limit = tl.minimum(limit, tl.load(len_ptr + b * stride_len))
        start = split * tiles_per_split * BLOCK_T
        end = tl.minimum(start + tiles_per_split * BLOCK_T, limit)
        k_base = k_ptr + b * stride_kb + kv_head * stride_kh
        v_base = v_ptr + b * stride_vb + kv_head * stride_vh
        running_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_in = t < end
            valid = tl.load(valid_ptr + b * stride_valid_b + t, mask=t_in, other=0) != 0
            kv_mask = t_in[:, None] & d_in[None, :]
            k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0)
            running_max, running_sum, acc = _online_softmax_step(
                q, k, v, valid, qk_scale, running_max, running_sum, acc, PRECISION
            )
        out_mask = g_in[:, None] & d_in[None, :]
        if SPLIT:  # unnormalised partials; _merge_splits_kernel finishes them
            out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
            tl.store(out + d[None, :], acc, mask=out_mask)
            stats = b * stride_mb + heads * stride_mh + split
            tl.store(max_ptr + stats, running_max, mask=g_in)
            tl.store(sum_ptr + stats, running_sum, mask=g_in)
        else:
            result = _normalised(acc, running_sum, v_scale_ptr)
            out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(out, result.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,
        max_ptr,
        sum_ptr,
        v_scale_ptr,
        out_ptr,
        splits,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_mb,
        stride_mh,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_in = s < splits
        stats = b * stride_mb + head * stride_mh + s
        maxes = tl.load(max_ptr + stats, mask=s_in, other=float("-inf"))
        sums = tl.load(sum_ptr + stats, mask=s_in, other=0.0)
        part = tl.load(
            part_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
            mask=s_in[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
        )
        overall = tl.max(maxes, 0)
        shift = tl.where(overall == float("-inf"), 0.0, overall)
        weights = tl.exp2(maxes - shift)
        total = tl.sum(weights * sums, 0)
        merged = tl.sum(weights[:, None] * part, 0)
        denominator = tl.where(total > 0.0, total, 1.0)
        result = merged / denominator * tl.load(v_scale_ptr)
        tl.store(
            out_ptr + b * stride_ob + head * stride_oh + d,
            result.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


def _scale_tensor(name: str, scale, device) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        # A host-to-device copy per call, which CUDA-graph capture does not allow.
        return torch.tensor(float(scale), dtype=torch.float32, device=device)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"{name} must be a one-element fp32 tensor, got {scale.dtype} {tuple(scale.shape)}"
        )
    return scale.reshape(())


def _check(q, k_cache, v_cache, kv_valid, kv_len, dtypes=QUERY_DTYPES):
    if q.dim() != 3 or q.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"q must be [B, Hq, D] {names}, got {q.dtype} {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.dtype != FP8 or v_cache.dtype != FP8:
        raise ValueError(
            f"k_cache and v_cache must be float8_e4m3fn [B, Hkv, Tmax, D], got "
            f"{k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    batch, q_heads, head_dim = q.shape
    cache_batch, kv_heads, t_max, cache_dim = k_cache.shape
    if (cache_batch, cache_dim) != (batch, head_dim) or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} and cache {tuple(k_cache.shape)}: need the same B and D, "
            "and Hq a multiple of Hkv"
        )
    if kv_valid.dtype != torch.bool or tuple(kv_valid.shape) != (batch, t_max):
        raise ValueError(
            f"kv_valid must be bool [{batch}, {t_max}], "
            f"got {kv_valid.dtype} {tuple(kv_valid.shape)}"
        )
    if kv_len is not None and (
        kv_len.dtype not in (torch.int32, torch.int64) or kv_len.numel() not in (1, batch)
    ):
        raise ValueError(f"kv_len must be int32/int64 [{batch}] or one element, got {kv_len.dtype}")


def fp8_kv_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    kv_valid: torch.Tensor,
    sm_scale: float | None = None,
    kv_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference (any device): dequantizes the cache (e4m3 · scale, fp32),
    scores = q·kᵀ · sm_scale, masked softmax over the valid positions in fp32 (float64
    for float64 queries), times v; output in q's dtype. See `fp8_kv_decode_attention`."""
    _check(q, k_cache, v_cache, kv_valid, kv_len, REFERENCE_QUERY_DTYPES)
    batch, q_heads, head_dim = q.shape
    kv_heads, t_max = k_cache.shape[1], k_cache.shape[2]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = (k_cache.float() * _scale_tensor("k_scale", k_scale, q.device)).to(compute)
    values = (v_cache.float() * _scale_tensor("v_scale", v_scale, q.device)).to(compute)
    queries = q.to(compute).view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * sm_scale  # [B, Hkv, G, T]
    valid = kv_valid
    if kv_len is not None:
        positions = torch.arange(t_max, device=q.device)
        valid = valid & (positions[None, :] < kv_len.reshape(-1, 1).to(q.device))
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A row with no valid position gives NaN; it attends to nothing, so 0 (as the kernel).
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, values).view(batch, q_heads, head_dim).to(q.dtype)


def _dot_precision(dtype: torch.dtype) -> str:
    # The dots run on fp32 operands. TF32 keeps 10 mantissa bits: every e4m3 key and
    # value and every bf16/fp16 query is exact in it, only the softmax weights round
    # (2^-11 relative, finer than a bf16 weight would be). fp32 queries get 3xTF32, about
    # fp32's precision. (Triton's interpreter gets bf16 dots wrong; fp32 ones it gets right.)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _splits(batch: int, kv_heads: int, tiles: int, tensor: torch.Tensor) -> int:
    # Enough programs for about two per multiprocessor, each on at least 4 tiles.
    want = ceil_div(2 * multiprocessors(tensor), batch * kv_heads)
    return max(1, min(want, tiles // 4))


def fp8_kv_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    kv_valid: torch.Tensor,
    sm_scale: float | None = None,
    kv_len: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_t: int | None = None,
) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1); see
    `fp8_kv_decode_attention`. `num_splits` (default: by the machine's size and the
    cache length) cuts each sequence's cache into that many parts run in parallel and
    merged; `block_t` is the number of cache positions per tile (a power of two ≥ 16)."""
    _check(q, k_cache, v_cache, kv_valid, kv_len)
    if not triton_runs_on(q):
        raise unavailable(
            "fp8_kv_decode_attention (Triton)",
            q,
            why_no_triton(q),
            "impl='reference' (dequantize, masked softmax in torch; any device)",
        )
    batch, q_heads, head_dim = q.shape
    kv_heads, t_max = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    k_scale = _scale_tensor("k_scale", k_scale, q.device)
    v_scale = _scale_tensor("v_scale", v_scale, q.device)
    q, k_cache, v_cache, valid = _rows_contiguous(q, k_cache, v_cache, kv_valid)
    block_t, splits, tiles_per_split = _tiling(q, kv_heads, t_max, num_splits, block_t)
    out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    lengths, stride_len = _lengths(kv_len, valid, q.device)
    target, maxes, sums, out_strides = _kernel_outputs(out, splits)
    block_d = max(16, next_power_of_2(head_dim))
    _fp8_kv_decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        valid,
        lengths,
        target,
        maxes,
        sums,
        sm_scale,
        t_max,
        tiles_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        valid.stride(0),
        stride_len,
        *out_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_T=block_t,
        HAS_LEN=kv_len is not None,
        SPLIT=splits > 1,
        PRECISION=_dot_precision(q.dtype),
    )
    if splits > 1:
        _merge_splits(target, maxes, sums, v_scale, out, block_d)
    return out


def _rows_contiguous(q, k_cache, v_cache, kv_valid):
    """The operands with their last dimension contiguous (copied only where it is not), the
    mask as bytes: Triton reads it with its own row stride, since the decoder's mask is a
    slice of its [B, Tmax] buffer and a copy would cost a kernel per layer per step."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    valid = (kv_valid if kv_valid.stride(-1) == 1 else kv_valid.contiguous()).view(torch.uint8)
    return q, k_cache, v_cache, valid


def _lengths(kv_len, valid, device) -> tuple[torch.Tensor, int]:
    """(the kernel's `len_ptr`, its stride): `kv_len` as int32 [B] or one element."""
    if kv_len is None:
        return valid, 0  # never read (HAS_LEN is off)
    lengths = kv_len.to(device=device, dtype=torch.int32).reshape(-1)
    return lengths, 0 if lengths.numel() == 1 else 1


def _kernel_outputs(out: torch.Tensor, splits: int):
    """(target, maxes, sums, strides) the decode kernel writes: `out` itself, or with splits
    fp32 partials [B, H, S, D] and their softmax maxima and sums, for `_merge_splits`.
    The strides: the target's (b, head, split), then the statistics' (b, head)."""
    batch, q_heads, head_dim = out.shape
    if splits > 1:
        partial = torch.empty(
            (batch, q_heads, splits, head_dim), dtype=torch.float32, device=out.device
        )
        maxes = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=out.device)
        sums = torch.empty_like(maxes)
        return partial, maxes, sums, (*partial.stride()[:3], maxes.stride(0), maxes.stride(1))
    # maxes and sums are never written (SPLIT is off)
    return out, out, out, (out.stride(0), out.stride(1), 0, 0, 0)


def _tiling(
    q: torch.Tensor, kv_heads: int, t_max: int, num_splits: int | None, block_t: int | None
) -> tuple[int, int, int]:
    """(cache positions per tile, splits of each sequence's cache, tiles per split)."""
    if block_t is None:
        block_t = 64 if q.is_cuda else 16
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    tiles = ceil_div(t_max, block_t)
    splits = _splits(q.shape[0], kv_heads, tiles, q) if num_splits is None else num_splits
    splits = max(1, min(int(splits), max(tiles, 1)))
    tiles_per_split = ceil_div(tiles, splits)
    return block_t, max(1, ceil_div(tiles, tiles_per_split)), tiles_per_split


def _merge_splits(
    partial: torch.Tensor,
    maxes: torch.Tensor,
    sums: torch.Tensor,
    v_scale: torch.Tensor,
    out: torch.Tensor,
    block_d: int,
) -> None:
    """Merges the splits' partial outputs [B, H, S, D] (with their softmax maxima and
    sums) into `out` [B, H, D]."""
    batch, q_heads, splits, head_dim = partial.shape
    _merge_splits_kernel[(batch, q_heads)](
        partial,
        maxes,
        sums,
        v_scale,
        out,
        splits,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        maxes.stride(0),
        maxes.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, next_power_of_2(splits)),
        BLOCK_D=block_d,
    )


def fp8_kv_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    kv_valid: torch.Tensor,
    sm_scale: float | None = None,
    kv_len: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of ONE new query token per sequence over an e4m3 KV cache: q [B, Hq, D],
    k_cache / v_cache float8_e4m3fn [B, Hkv, Tmax, D], k_scale / v_scale fp32 0-dim tensors,
    kv_valid bool [B, Tmax], kv_len None or int [B]; [B, Hq, D] in q's dtype, zeros where no
    position is valid (the full contract: docs/precision.md, "Kernels"). impl: "auto" (Triton
    on CUDA for non-float64 q, else the torch reference), "triton" or "reference"."""
    check_impl(impl, ("auto", "triton", "reference"))
    triton_takes = q.is_cuda and q.dtype != torch.float64 and triton_runs_on(q)
    if impl == "triton" or (impl == "auto" and triton_takes):
        return fp8_kv_decode_attention_triton(
            q, k_cache, v_cache, k_scale, v_scale, kv_valid, sm_scale, kv_len
        )
    return fp8_kv_decode_attention_reference(
        q, k_cache, v_cache, k_scale, v_scale, kv_valid, sm_scale, kv_len
    )
