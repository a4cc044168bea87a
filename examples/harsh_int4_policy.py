"""A harsh rollout precision, for a positive control (issue 26, part 4): integer
weight-only rounding, one scale per `group_size` input columns of each output row, 3
bits by default (INT4's format with one bit less; `precision.bits=4` is INT4-g128, as
AWQ / GPTQ checkpoints use). Run without correction it must measurably hurt learning,
so that a parity study shows it can see mismatch damage.

    PYTHONPATH=examples python -m asyncfp8.launch \
        precision._target_=harsh_int4_policy.IntWeightOnlyPolicy correction=none
    PYTHONPATH=examples python -m asyncfp8.demo \
        precision._target_=harsh_int4_policy.IntWeightOnlyPolicy precision.bits=4

The format, per row and per `group_size` consecutive input columns (a row that is not a
whole number of groups ends with a shorter one): qmax = 2^(bits-1) - 1,
s = max|w| / qmax (max|w| floored at 1e-10), q = round(w / s) (half to even) clamped to
[-qmax - 1, qmax]; bits=4: s = amax / 7, q in [-8, 7]. Symmetric, not asymmetric (a zero point per
group): the common weight-only scheme and the simpler one, and a control needs a large,
known error; 2^bits levels over [min, max] would make it milder. Rounded: every linear
weight the built-in formats quantize (attention and MLP projections); embeddings, the
LM head, norms, biases and MoE routers stay in BF16, as do activations and the KV cache.

Fake-quant, so every engine runs it with no new kernel: a version carries, under each
weight's own name, the dequantized q * s in the engine dtype (BF16), i.e. BF16 tensors
that hold the integer rounding error. The torch engine multiplies them in BF16
(`DequantizedLinear`); vLLM and SGLang are started from the BF16 model (no
`quantization_config`: the policy has no checkpoint format) and load each version as
they load BF16 weights, so they run the rounded weights from the first version on (a
worker waits for it before it generates). This measures accuracy, not speed: a real
INT4 kernel (Marlin, Machete) computes the same products faster.

`precision.learner_forward=quantized` works as for FP8 and INT8: the learner's linear
layers multiply `fake_quantize_weight`, which is the published tensor bit for bit, with
straight-through gradients to the FP32 master weights.

Why 3 bits by default. On the project's models a group of 128 already spans a whole row
of every projection that reads the hidden state (hidden 64 in `tiny`, 128 in `small`;
only `down_proj` has 2 or 3 groups), so a larger group cannot make INT4 harsher, and
INT4 there is not harsh: its k3 mismatch is 1.2-7.5x FP8's on three `tiny` models and
5x on `small` (the demo's measurement: the engine samples at temperature 1, the FP32
learner recomputes; 2-core AMD EPYC), not an order of magnitude from the format whose
parity the study claims.
One bit less quadruples the rounding noise's power: INT3-g128 is 7-52x FP8's k3 on
`tiny` and 21x on `small`, while the rollouts' own reward stays near BF16's: the damage
a run without correction takes is the mismatch's, not that of worse samples. INT2
(130-800x) halves that reward, which confounds the two. The numbers, and how to measure
them again on another testbed: docs/precision.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.kernel_support import ceil_div
from asyncfp8.precision.modules import QuantizedLinear
from asyncfp8.precision.policy import check_weight

AMAX_FLOOR = 1e-10  # as the built-in formats: an all-zero group keeps a finite scale


def quantize_groupwise(
    w: torch.Tensor, group_size: int = 128, bits: int = 3, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, N] in [-2^(bits-1), 2^(bits-1) - 1], scale fp32 [M, ceil(N / group)])
    with w ≈ q * scale per row and group of input columns. A short last group is
    zero-padded (a zero never changes a group's max |w|) and cropped back."""
    check_weight(name, w)
    qmax = 2 ** (bits - 1) - 1
    rows, cols = w.shape
    groups = ceil_div(cols, group_size)
    padded = F.pad(w.float(), (0, groups * group_size - cols)).view(rows, groups, group_size)
    scale = padded.abs().amax(-1).clamp_min(AMAX_FLOOR) / qmax
    q = torch.round(padded / scale[..., None]).clamp(-qmax - 1, qmax).to(torch.int8)
    return q.view(rows, -1)[:, :cols].contiguous(), scale


def dequantize_groupwise(
    q: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q * scale, each scale broadcast over its group's columns, computed in FP32."""
    per_column = scale.float().repeat_interleave(group_size, 1)[:, : q.shape[1]]
    return (q.float() * per_column).to(dtype)


class DequantizedLinear(QuantizedLinear):
    """The torch engine's module for a rounded layer: the version's dequantized weight,
    held in its own buffer (new versions are copied in place), multiplied in the
    activations' dtype, as vLLM's and SGLang's unquantized linear layers do.
    `real=False` (the fake-quant twin) multiplies in FP32."""

    def __init__(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, real: bool = True
    ):
        super().__init__({name: weight}, bias)
        self.weight_name, self.real = name, real
        self.out_features, self.in_features = weight.shape
        self.register_buffer("dequantized", torch.empty_like(weight), persistent=False)
        self.load({name: weight})

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.dequantized.copy_(tensors[self.weight_name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if self.real else torch.float32
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.dequantized.to(dtype), bias).to(x.dtype)


class IntWeightOnlyPolicy(PrecisionPolicy):
    """Integer weight-only groupwise rounding (3 bits, groups of 128 by default),
    published dequantized in the engine dtype. See the module docstring."""

    name = "int_weight_only"
    quantizes_weights = True  # the per-tensor decision and the learner's fake-quant apply

    def __init__(self, group_size: int = 128, bits: int = 3):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(
                "precision.group_size must be an int >= 1 (input columns per scale), "
                f"got {group_size!r}"
            )
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise ValueError(
                f"precision.bits must be an int from 2 to 8 (signed integer codes), got {bits!r}"
            )
        self.group_size, self.bits = group_size, bits

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield name, self.fake_quantize_weight(name, tensor)

    def linear_module(self, name, tensors, bias, real=True):
        return DequantizedLinear(name, tensors[name], bias, real)

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        # Rounded to the engine dtype here, so the learner multiplies what the engine does.
        q, scale = quantize_groupwise(weight, self.group_size, self.bits, name=name)
        return dequantize_groupwise(q, scale, self.group_size, self.engine_dtype)
