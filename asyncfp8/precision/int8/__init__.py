"""INT8 W8A8: per-output-channel symmetric weights, dynamic per-token activations.

This folder (plus conf/precision/int8.yaml) is the whole format: the policy (here) with its
optional SmoothQuant profile, the quantizers (quant.py), the INT8 GEMM (gemm.py) and the torch
engine's `Int8Linear` (linear.py). The tensors: docs/precision.md, "The formats' tensors"."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..policy import PrecisionPolicy, dtype_name
from ..profile_file import ROWS, load_profile
from ..registry import register_policy
from ..storage import ScaleLayout, Storage
from .linear import Int8Linear
from .quant import (
    SCALE_SUFFIX,
    dequantize_per_channel,
    quantize_activations_int8,
    quantize_per_channel,
    quantize_per_channel_reference,
)

__all__ = [
    "SCALE_SUFFIX",
    "INT8Policy",
    "Int8Linear",
    "compressed_tensors_config",
    "dequantize_per_channel",
    "quantize_activations_int8",
    "quantize_per_channel",
    "quantize_per_channel_reference",
]


def compressed_tensors_config(ignore: Iterable[str] = ()) -> dict:
    """HF `quantization_config` for compressed-tensors W8A8 INT8 (channel / token);
    `ignore` lists layers left unquantized (the LM head always is)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", *sorted(set(ignore) - {"lm_head"})],
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
        self.smoothing: dict[str, torch.Tensor] = {}  # as read, on the CPU
        # The factors on each device they were asked for (the weights of a learner or
        # an engine on a GPU), copied there once.
        self._smoothing_on: dict[tuple[str, torch.device], torch.Tensor] = {}
        if profile:
            self.smoothing = load_profile(Path(profile))

    def _smoothed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A weight in the smoothed coordinates: its columns times its input factors, its
        rows divided by its output divisors (a producer of a fold, profile.ROWS)."""
        columns, rows = self._factors(name, tensor), self._factors(name + ROWS, tensor)
        if columns is None and rows is None:
            return tensor
        tensor = tensor.float()
        if columns is not None:
            tensor = tensor * columns[None, :]
        if rows is not None:
            tensor = tensor / rows[:, None]
        return tensor

    def _unsmoothed(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        columns, rows = self._factors(name, tensor), self._factors(name + ROWS, tensor)
        if columns is not None:
            tensor = tensor / columns[None, :]
        if rows is not None:
            tensor = tensor * rows[:, None]
        return tensor

    def _factors(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The smoothing factors of `name` on `like`'s device, or None if it has none."""
        factors = self.smoothing.get(name)
        if factors is None or factors.device == like.device:
            return factors
        key = (name, like.device)
        if key not in self._smoothing_on:
            self._smoothing_on[key] = factors.to(like.device)
        return self._smoothing_on[key]

    def checkpoint_config(self, unquantized_layers: Iterable[str] = ()) -> dict:
        return compressed_tensors_config(unquantized_layers)

    def engine_config(self) -> dict:
        return {
            "dtype": dtype_name(self.engine_dtype),
            "quantization": "compressed-tensors",
            "quantization_config": self.checkpoint_config(),
        }

    def storage(self) -> Storage:
        return Storage(torch.int8, ScaleLayout(rows=1, cols=None), compute="int8")

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # Input channel j of this layer is divided by s_j (the norm or the layer before it
        # was, in `passthrough`), so the layer sees x/s·(w·s) = x·w; its own output
        # channels divided by r are multiplied back by the layer after it.
        q, scale = quantize_per_channel(self._smoothed(name, tensor), name=name)
        yield name, q
        yield name + SCALE_SUFFIX, scale

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 1:
            # A norm before smoothed linears, or a fold's producer's bias, is divided by s.
            factors = self._factors(name, tensor)
            if factors is not None:
                tensor = tensor.float() / factors
        else:
            # A smoothed linear left unquantized (a mixed layout's, a subclass's choice)
            # is smoothed as a quantized one is: the float product stays.
            tensor = self._smoothed(name, tensor)
        return super().passthrough(name, tensor)

    def linear_module(self, name, tensors, bias, real=True):
        return Int8Linear(name, tensors[name], tensors[name + SCALE_SUFFIX], bias, real)

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        # In the learner's unsmoothed coordinates: dq(q(w·s))/s times dq(q(x/s))·s is the
        # engine's product, and the straight-through gradient stays the float layer's.
        q, scale = quantize_per_channel(self._smoothed(name, weight), name=name)
        return self._unsmoothed(name, dequantize_per_channel(q, scale))

    def reference_matmul(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Int8Linear's order: exact integer sums, then × activation scale × weight scale.
        # `x` is the engine's input, already divided by the smoothing factors (the
        # reference holds the norms and the layers before as `passthrough` gives them);
        # the weight is smoothed as `quantize_tensor` smooths it.
        q, scale = quantize_per_channel(self._smoothed(name, weight), name=name)
        xq, x_scale = quantize_activations_int8(x.reshape(-1, x.shape[-1]))
        out = (xq.double() @ q.double().t()).float() * x_scale * scale.t()
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def fake_quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        factors = self._factors(name, x)
        flat = x.reshape(-1, x.shape[-1]).float()
        if factors is not None:
            flat = flat / factors[None, :]
        q, scale = quantize_activations_int8(flat)
        dequantized = q.float() * scale
        if factors is not None:
            dequantized = dequantized * factors[None, :]
        return dequantized.reshape(x.shape)
