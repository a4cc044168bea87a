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

import logging
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from .modules import QuantizedLinear
from .policy import PrecisionPolicy, ceil_div, check_weight, register_policy

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-10
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"

log = logging.getLogger(__name__)
# The scaled_mm failures already reported (one warning per kind, not one per layer).
_scaled_mm_failures: set[str] = set()


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


def quantize_activations_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of `group`) -> (e4m3 [T, K], fp32 scales [T, K/group]):
    dynamic, per token and per `group` columns, as vLLM's blockwise FP8 path does."""
    tokens, width = x.shape
    groups = x.float().view(tokens, width // group, group)
    scale = groups.abs().amax(-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(tokens, width), scale


def fake_quantize_activations_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the FP8 GEMM sees it (quantized and dequantized per token per group), in fp32;
    K need not be a multiple of `group` (zero padding, as the engine pads)."""
    width = x.shape[-1]
    flat = F.pad(x.reshape(-1, width).float(), (0, -width % group))
    q, scale = quantize_activations_fp8(flat, group)
    dequantized = q.float().view(flat.shape[0], -1, group) * scale[..., None]
    return dequantized.view(flat.shape)[:, :width].reshape(x.shape)


class FP8BlockLinear(QuantizedLinear):
    """W8A8 blockwise FP8 for the built-in engine: activations quantized per token per
    `block[1]` columns, weights per `block` block, accumulated in FP32. `real=True` runs
    real e4m3 GEMMs through `asyncfp8.engines.kernels.fp8_block_matmul`: one torch
    `scaled_mm` call on sm90 GPUs, the Triton kernel on other GPUs, and on the CPU the
    per-block `torch._scaled_mm` loop (the reference numerics); `real=False` is the
    fake-quant twin (the same rounding, float matmul), for checking the real kernels
    against.

    The weight is held zero-padded to whole blocks (so that every path gets K and N in
    whole blocks; the output is cropped), and on sm90 also its scales in the layout
    `scaled_mm` takes. A new version is copied into these buffers in place: a captured
    CUDA graph keeps reading the right memory.

    If the one-call `scaled_mm` raises (cuBLASLt refuses a shape or the FP32 output on
    some driver), the layer says so once and uses the Triton GEMM (or the reference
    loop) from then on: the engine's probe at start, and the warm-up before a CUDA graph
    is captured, meet such a failure before any graph does."""

    def __init__(
        self,
        name: str,
        q: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] = BLOCK,
        real: bool = True,
    ):
        from asyncfp8.engines.kernels import scaled_mm_available, scaled_mm_weight_scales

        super().__init__({name: q, name + SCALE_SUFFIX: scale_inv}, bias)
        self.weight_name, self.block, self.real = name, tuple(block), real
        self.out_features, self.in_features = q.shape
        grid_rows, grid_cols = scale_inv.shape
        block_rows, block_cols = self.block
        # The padding stays zero across updates (`load` writes the unpadded part only).
        self.register_buffer(
            "q",
            torch.zeros(
                grid_rows * block_rows,
                grid_cols * block_cols,
                dtype=torch.float8_e4m3fn,
                device=q.device,
            ),
            persistent=False,
        )
        self.register_buffer(
            "scale_inv", torch.empty_like(scale_inv, dtype=torch.float32), persistent=False
        )
        sm90 = real and self.block == BLOCK and scaled_mm_available(self.q)
        self.register_buffer(
            "scale_mm",
            scaled_mm_weight_scales(self.scale_inv) if sm90 else None,
            persistent=False,
        )
        #: the GEMM path `fp8_block_matmul` takes ("scaled_mm" on sm90 until it fails)
        self.impl = "scaled_mm" if sm90 else "auto"
        self.load({name: q, name + SCALE_SUFFIX: scale_inv})

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from asyncfp8.engines.kernels import scaled_mm_weight_scales

        q, scale_inv = tensors[self.weight_name], tensors[self.weight_name + SCALE_SUFFIX]
        rows, cols = q.shape
        self.q.view(torch.uint8)[:rows, :cols].copy_(q.view(torch.uint8))
        self.scale_inv.copy_(scale_inv)
        if self.scale_mm is not None:
            self.scale_mm.copy_(scaled_mm_weight_scales(self.scale_inv))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        group = self.block[1]
        x = x.reshape(-1, self.in_features)
        padding = self.q.shape[1] - self.in_features
        if padding:  # zero columns up to the padded K: no group's amax changes, they quantize to 0
            x = F.pad(x, (0, padding))
        if self.real:
            out = self._real_matmul(x, group)
        else:
            xq, x_scale = quantize_activations_fp8(x, group)
            x_deq = (xq.float().view(x.shape[0], -1, group) * x_scale[..., None]).view(x.shape)
            rows, cols = self.out_features, self.in_features
            w_deq = dequantize_blockwise(self.q[:rows, :cols], self.scale_inv, self.block)
            out = x_deq[:, :cols] @ w_deq.t()
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype).reshape(*shape[:-1], self.out_features)

    def _real_matmul(self, x: torch.Tensor, group: int) -> torch.Tensor:
        from asyncfp8.engines import kernels
        from asyncfp8.engines.kernels.common import triton_runs_on

        one_call = self.impl == "scaled_mm"
        xq, x_scale = kernels.quantize_activations_fp8(x, group, column_major_scales=one_call)
        try:
            return kernels.fp8_block_matmul(
                xq,
                x_scale,
                self.q,
                self.scale_inv,
                self.block,
                torch.float32,
                impl=self.impl,
                w_scale_mm=self.scale_mm,
            )
        except RuntimeError as err:
            if not one_call or isinstance(err, kernels.KernelUnavailable):
                raise
            self.impl = "triton" if triton_runs_on(self.q) else "reference"
            self.scale_mm = None
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            log.log(
                logging.DEBUG if reason in _scaled_mm_failures else logging.WARNING,
                "FP8 GEMM: torch's one-call scaled_mm failed for %s (%d tokens, weight %s): "
                "%s; the layer (and any other it fails in) uses impl=%r from now on",
                self.weight_name,
                x.shape[0],
                list(self.q.shape),
                reason,
                self.impl,
            )
            _scaled_mm_failures.add(reason)
            return self._real_matmul(x, group)


@register_policy("fp8")
class FP8Policy(PrecisionPolicy):
    """W8A8 FP8 with 128×128 weight blocks (`block_size`) and dynamic per-token-group
    activations (groups as wide as a weight block)."""

    name = "fp8"
    quantizes_weights = True

    def __init__(self, block_size: tuple[int, int] | list[int] = BLOCK):
        if len(block_size) != 2 or not all(isinstance(b, int) and b >= 16 for b in block_size):
            raise ValueError(
                f"fp8: block_size must be two ints >= 16 (the e4m3 GEMMs work on slices of at "
                f"least 16), got {list(block_size)}"
            )
        if any(b % 16 for b in block_size):
            raise ValueError(f"fp8: block_size must be multiples of 16, got {list(block_size)}")
        self.block = (int(block_size[0]), int(block_size[1]))

    def checkpoint_config(self, unquantized_layers: Iterable[str] = ()) -> dict:
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
        }
        layers = sorted(unquantized_layers)
        if layers:
            config["ignored_layers"] = layers  # vLLM / SGLang skip quantization there
        return config

    def engine_config(self) -> dict:
        return {
            "dtype": "bfloat16",
            "quantization": "fp8",
            "quantization_config": self.checkpoint_config(),
        }

    def supported_by(self, engine: str) -> str | None:
        if engine in ("vllm", "sglang") and self.block != BLOCK:
            return (
                f"its block-FP8 kernels are built and tested for 128x128 weight blocks; "
                f"precision.block_size={list(self.block)} runs on engine=torch"
            )
        if engine in ("vllm", "sglang") and self.model_config is not None:
            # Their loaders fuse q/k/v and gate/up and split the fused scale grid by
            # block: every part must be whole blocks (checked here, not as a load error).
            config = self.model_config
            head_dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
            sizes = {
                "intermediate_size": config.intermediate_size,
                "hidden_size": config.hidden_size,
                "num_attention_heads x head_dim": config.num_attention_heads * head_dim,
                "num_key_value_heads x head_dim": config.num_key_value_heads * head_dim,
            }
            odd = {k: v for k, v in sizes.items() if v % self.block[0] or v % self.block[1]}
            if odd:
                return (
                    f"its block-FP8 loader needs every fused projection in whole "
                    f"{self.block[0]}x{self.block[1]} blocks, and this model's "
                    + ", ".join(f"{k} = {v}" for k, v in odd.items())
                    + " is not; engine=torch pads odd shapes"
                )
        return super().supported_by(engine)

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        q, scale_inv = quantize_blockwise(tensor, self.block, name=name)
        yield name, q
        yield name + SCALE_SUFFIX, scale_inv

    def linear_module(self, name, tensors, bias, real=True):
        return FP8BlockLinear(
            name, tensors[name], tensors[name + SCALE_SUFFIX], bias, self.block, real
        )

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        q, scale_inv = quantize_blockwise(weight, self.block, name=name)
        return dequantize_blockwise(q, scale_inv, self.block)

    def fake_quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activations_fp8(x, self.block[1])

    def reference_matmul(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fp8_block_matmul's order: each K block's dequantized product summed alone and
        # added to the FP32 output in K order, the last block zero-padded to full width.
        # One sum over all of K rounds otherwise (1 BF16 ulp in 1 of 20 probes, measured).
        block = self.block[1]
        padding = -x.shape[-1] % block
        inputs = F.pad(self.fake_quantize_input(name, x).float(), (0, padding))
        weight = F.pad(self.fake_quantize_weight(name, weight).float(), (0, padding))
        out = inputs.new_zeros(*inputs.shape[:-1], weight.shape[0])
        for start in range(0, inputs.shape[-1], block):
            out += inputs[..., start : start + block] @ weight[:, start : start + block].t()
        return out
