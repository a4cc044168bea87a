"""INT8 W8A8: per-output-channel symmetric weights, dynamic per-token activations.

s = max_row(|w|)/127 (floored at 1e-10/127), q = round(w / s) clamped to [−128, 127]
(round half to even), stored in the compressed-tensors `int-quantized` layout that
vLLM loads: `<prefix>.weight` (int8 [M, N]) and `<prefix>.weight_scale` (fp32 [M, 1]).

An optional SmoothQuant-style profile (per-input-channel factors, computed once by
`python -m asyncfp8.precision.profile`) divides each linear layer's input channels by
a factor and multiplies the preceding norm's weight by it: the product is unchanged,
activation outliers shrink, and INT8 per-token activations lose less.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from .policy import PrecisionPolicy, check_weight, is_quantizable, register_policy

INT8_MAX = 127.0
AMAX_FLOOR = 1e-10
SCALE_SUFFIX = "_scale"


def quantize_per_channel_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) / INT8_MAX
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_per_channel(
    w: torch.Tensor, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, N], scale fp32 [M, 1]) with w ≈ q · scale row by row."""
    check_weight(name, w)
    from . import kernels

    if kernels.triton_enabled(w):
        return kernels.quantize_per_channel_triton(w)
    return quantize_per_channel_reference(w)


def dequantize_per_channel(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if scale.shape != (q.shape[0], 1):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}; a {tuple(q.shape)} weight needs ({q.shape[0]}, 1)"
        )
    return (q.float() * scale.float()).to(dtype)


def compressed_tensors_config() -> dict:
    """HF `quantization_config` for compressed-tensors W8A8 INT8 (channel / token)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    }


@register_policy("int8")
class INT8Policy(PrecisionPolicy):
    """W8A8 INT8; `profile` (a safetensors file from asyncfp8.precision.profile) turns on
    SmoothQuant smoothing, the same factors every version."""

    name = "int8"
    quantizes_weights = True

    def __init__(self, profile: str | None = None):
        self.profile_path = profile
        self.smoothing: dict[str, torch.Tensor] = {}
        if profile:
            from .profile import load_profile

            self.smoothing = load_profile(Path(profile))

    def checkpoint_config(self) -> dict:
        return compressed_tensors_config()

    def engine_config(self) -> dict:
        return {
            "quantization": "compressed-tensors",
            "quantization_config": self.checkpoint_config(),
        }

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        factors = self.smoothing.get(name)
        if factors is not None:
            # Input channel j of this layer is divided by s_j; the norm before it was
            # multiplied by s_j (in `passthrough`), so the layer sees x/s·(w·s) = x·w.
            tensor = tensor.float() * factors[None, :]
        q, scale = quantize_per_channel(tensor, name=name)
        yield name, q
        yield name + SCALE_SUFFIX, scale

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        factors = self.smoothing.get(name)
        if factors is None or is_quantizable(
            name, tensor
        ):  # the linears are scaled in quantize_tensor
            return tensor
        return (tensor.float() / factors).to(tensor.dtype)
