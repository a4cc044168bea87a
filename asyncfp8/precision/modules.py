"""Quantized linear layers for the built-in torch engine, so that the mismatch a real
engine shows is reproduced on any machine, CPU included.

`FP8BlockLinear` runs W8A8 blockwise FP8 the way vLLM's GPU path does: activations
quantized per token and per 128-column group (dynamic), weights per 128×128 block, one
real FP8 GEMM (`torch._scaled_mm`, rowwise scales) per 128-wide slice of the inner
dimension, accumulated in FP32. `Int8Linear` quantizes activations per token and runs
`torch._int_mm` (int8 × int8 → int32), scaled by the per-token and per-channel scales.
Each has `real=False`, a fake-quant twin (quantize, dequantize, float matmul): the same
rounding, for checking the real kernels against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FP8_MAX, dequantize_blockwise
from .fp8 import SCALE_SUFFIX as FP8_SCALE_SUFFIX
from .int8 import INT8_MAX
from .int8 import SCALE_SUFFIX as INT8_SCALE_SUFFIX
from .policy import PrecisionPolicy, is_quantizable

GROUP = 128


def quantize_activations_fp8(
    x: torch.Tensor, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K a multiple of `group`) -> (e4m3 [T, K], fp32 scales [T, K/group])."""
    tokens, width = x.shape
    groups = x.float().view(tokens, width // group, group)
    scale = groups.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(tokens, width), scale


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 [T, K], fp32 per-token scales [T, 1])."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-10) / INT8_MAX
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


class FP8BlockLinear(nn.Module):
    def __init__(
        self, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None, real: bool = True
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.real = real
        self.register_buffer("bias", bias, persistent=False)
        self.load(q, scale_inv)

    def load(self, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Takes a new version's weight in place (shapes must not change)."""
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"FP8BlockLinear: weight {tuple(q.shape)} != {(self.out_features, self.in_features)}"
            )
        grid_rows, grid_cols = scale_inv.shape
        # Padded to whole blocks once, so every 128-wide slice is a full GEMM operand.
        self.register_buffer(
            "q",
            _pad_to(q.view(torch.uint8), grid_rows * GROUP, grid_cols * GROUP).view(
                torch.float8_e4m3fn
            ),
            persistent=False,
        )
        self.register_buffer("scale_inv", scale_inv.float().contiguous(), persistent=False)
        # The weight scale of every output row, for each inner-dimension block: [K/128, 1, M_pad].
        self.register_buffer(
            "row_scales",
            scale_inv.float().t().repeat_interleave(GROUP, 1)[:, None, :].contiguous(),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, self.in_features)
        x = F.pad(x, (0, self.q.shape[1] - self.in_features))
        xq, x_scale = quantize_activations_fp8(x)
        if self.real:
            out = torch.zeros(x.shape[0], self.q.shape[0], dtype=torch.float32, device=x.device)
            for block in range(self.scale_inv.shape[1]):
                cols = slice(block * GROUP, (block + 1) * GROUP)
                out += torch._scaled_mm(
                    xq[:, cols],
                    self.q[:, cols].t(),
                    scale_a=x_scale[:, block : block + 1].contiguous(),
                    scale_b=self.row_scales[block],
                    out_dtype=torch.float32,
                )
        else:
            x_deq = (xq.float().view(x.shape[0], -1, GROUP) * x_scale[..., None]).view(x.shape)
            w_deq = dequantize_blockwise(self.q, self.scale_inv)
            out = x_deq @ w_deq.t()
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(dtype).reshape(*shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, real: bool = True
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.real = real
        self.register_buffer("bias", bias, persistent=False)
        self.load(q, scale)

    def load(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Int8Linear: weight {tuple(q.shape)} != {(self.out_features, self.in_features)}"
            )
        self.register_buffer("q", q.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().reshape(-1, 1).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = quantize_activations_int8(x.reshape(-1, self.in_features))
        if self.real:
            accumulated = torch._int_mm(xq, self.q.t()).float()
        else:
            accumulated = xq.double() @ self.q.double().t()  # exact integer sums
        out = accumulated.float() * x_scale * self.scale.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)


def apply_policy(model: nn.Module, policy: PrecisionPolicy, real: bool = True) -> nn.Module:
    """Replaces, in place, every linear layer whose weight the policy quantizes by the
    matching quantized module (FP8BlockLinear for blockwise FP8 weights, Int8Linear for
    INT8), and passes the other parameters through the policy (which may rescale them,
    as INT8 smoothing does the norms). Returns the model."""
    if not policy.quantizes_weights:
        return model
    with torch.no_grad():  # tensors the policy keeps but may rescale (SmoothQuant-folded norms)
        for name, param in model.named_parameters():
            if not is_quantizable(name, param):
                param.copy_(policy.passthrough(name, param.detach()))
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            weight_name = f"{module_name}.{child_name}.weight".lstrip(".")
            if not is_quantizable(weight_name, child.weight):
                continue
            produced = dict(policy.quantize_tensor(weight_name, child.weight.detach()))
            bias = child.bias.detach() if child.bias is not None else None
            if weight_name + FP8_SCALE_SUFFIX in produced:
                new = FP8BlockLinear(
                    produced[weight_name], produced[weight_name + FP8_SCALE_SUFFIX], bias, real
                )
            elif weight_name + INT8_SCALE_SUFFIX in produced:
                new = Int8Linear(
                    produced[weight_name], produced[weight_name + INT8_SCALE_SUFFIX], bias, real
                )
            else:
                raise ValueError(
                    f"{weight_name}: policy {policy.name!r} produced {sorted(produced)}, "
                    "which no quantized module here runs"
                )
            setattr(module, child_name, new)
    return model
