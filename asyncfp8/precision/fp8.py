"""FP8 W8A8, blockwise: the DeepSeek-V3 / vLLM / SGLang checkpoint format.

Each 128×128 block of a linear weight gets its own scale s = max(|w|)/448 (floored
at 1e-10), q = clamp(w / s, ±448) cast to e4m3 (round to nearest even), stored as
`<name>` (float8_e4m3fn) and `<name>_scale_inv` (fp32 s, [⌈M/128⌉, ⌈N/128⌉]). Odd
shapes are zero-padded to whole blocks, quantized, and `q` cropped back; the scale
keeps its rounded-up shape. Activations are quantized on the fly by the engine, per
token and per 128-column group. A block scale keeps a change local: an RL step that
moves a few weights changes at most their blocks' scales.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .policy import PrecisionPolicy, ceil_div, check_weight, register_policy

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-10
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


def quantize_blockwise_reference(
    w: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (any device). See `quantize_blockwise`."""
    rows, cols = w.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = ceil_div(rows, block_rows), ceil_div(cols, block_cols)
    padded = torch.zeros(
        grid_rows * block_rows, grid_cols * block_cols, dtype=torch.float32, device=w.device
    )
    padded[:rows, :cols] = w
    blocks = padded.view(grid_rows, block_rows, grid_cols, block_cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:rows, :cols].contiguous(), scale


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, N], scale_inv fp32 [⌈M/bm⌉, ⌈N/bn⌉]) with w ≈ q · scale_inv
    per block. Uses the Triton kernel on CUDA when it is available, the torch reference
    elsewhere; both give the same bytes."""
    check_weight(name, w)
    from . import kernels

    if kernels.triton_enabled(w):
        return kernels.quantize_blockwise_triton(w, block)
    return quantize_blockwise_reference(w, block)


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q · scale_inv, each scale broadcast over its block."""
    rows, cols = q.shape
    expected = (ceil_div(rows, block[0]), ceil_div(cols, block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}; a {rows}x{cols} weight needs {expected}"
        )
    scale = (
        scale_inv.float()
        .repeat_interleave(block[0], 0)[:rows]
        .repeat_interleave(block[1], 1)[:, :cols]
    )
    return (q.float() * scale).to(dtype)


@register_policy("fp8")
class FP8Policy(PrecisionPolicy):
    """W8A8 FP8 with 128×128 weight blocks and dynamic per-token-group activations."""

    name = "fp8"
    quantizes_weights = True

    def __init__(self, block_size: tuple[int, int] | list[int] = BLOCK):
        if len(block_size) != 2 or min(block_size) < 1:
            raise ValueError(f"fp8: block_size must be two positive ints, got {block_size}")
        self.block = (int(block_size[0]), int(block_size[1]))

    def checkpoint_config(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
        }

    def engine_config(self) -> dict:
        return {"quantization": "fp8", "quantization_config": self.checkpoint_config()}

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        q, scale_inv = quantize_blockwise(tensor, self.block, name=name)
        yield name, q
        yield name + SCALE_SUFFIX, scale_inv
