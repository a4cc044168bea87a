"""Quantized linear layers, engine side and learner side, for any policy.

Engine side: `apply_policy` swaps each linear layer the policy `quantizes` for the policy's
`QuantizedLinear`, which owns its tensors and copies each version into its own storage.
Learner side: `use_fake_quant`, straight-through gradients (docs/precision.md has both)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from torch import nn

from asyncfp8.hf.cpu_half import is_plain_linear


class QuantizingPolicy(Protocol):
    """What these layers ask of a policy (asyncfp8.precision.policy.PrecisionPolicy has it
    all): which weights it quantizes, into which tensors and runtime module, what it does
    to every other parameter, and its quantize-dequantize rounding for the learner. A
    protocol, so that the policy module imports this one and not the other way round."""

    name: str

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool: ...

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def linear_module(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        bias: torch.Tensor | None,
        real: bool = True,
    ) -> nn.Module: ...

    def fake_quantize_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor: ...

    def fake_quantize_input(self, name: str, x: torch.Tensor) -> torch.Tensor: ...


class QuantizedLinear(nn.Module):
    """Base of a policy's runtime module: owns the engine-side tensors a policy produced
    for one learner weight (e.g. `...weight` in e4m3 and `...weight_scale_inv`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], bias: torch.Tensor | None):
        super().__init__()
        #: full name -> (shape, dtype) of every tensor a version must bring for this layer
        self.expects = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        #: the learner weight these tensors were made from (set by `apply_policy`)
        self.source_name = ""
        self.register_buffer("bias", bias, persistent=False)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copies a checked version's tensors (every one in `expects`) into this module's
        buffers, in place."""
        raise NotImplementedError


def apply_policy(model: nn.Module, policy: QuantizingPolicy, real: bool = True) -> nn.Module:
    """Replaces, in place, every linear layer whose weight `policy.quantizes` by
    `policy.linear_module`, and passes every other parameter through the policy (which
    may rescale it, as INT8 smoothing does the norms). Returns the model."""
    linear_weights = {
        f"{prefix}.{child_name}.weight".lstrip("."): (module, child_name, child)
        for prefix, module in model.named_modules()
        for child_name, child in module.named_children()
        if isinstance(child, nn.Linear)
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not (name in linear_weights and policy.quantizes(name, param)):
                param.copy_(policy.passthrough(name, param.detach()))
    for weight_name, (parent, child_name, child) in linear_weights.items():
        if not policy.quantizes(weight_name, child.weight):
            continue
        produced = dict(policy.quantize_tensor(weight_name, child.weight.detach()))
        bias = child.bias.detach() if child.bias is not None else None
        module = policy.linear_module(weight_name, produced, bias, real)
        if not isinstance(module, QuantizedLinear):
            raise TypeError(
                f"precision {policy.name!r}: linear_module gave a {type(module).__name__} for "
                f"{weight_name}, not an asyncfp8.precision.modules.QuantizedLinear"
            )
        module.source_name = weight_name
        setattr(parent, child_name, module)
    return model


def straight_through(value: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """`quantized` in the forward pass, the identity's gradient to `value` in the backward."""
    return value + (quantized.to(value.dtype) - value).detach()


class FakeQuantLinear(nn.Linear):
    """An nn.Linear (same `weight` and `bias` parameters, so the same names and optimizer
    state) whose forward multiplies the policy's quantize-dequantized input and weight."""

    def __init__(self, linear: nn.Linear, name: str, policy: QuantizingPolicy):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.quantized_name, self.policy = name, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            weight = self.policy.fake_quantize_weight(self.quantized_name, self.weight.detach())
            inputs = self.policy.fake_quantize_input(self.quantized_name, x.detach())
        return nn.functional.linear(
            straight_through(x, inputs), straight_through(self.weight, weight), self.bias
        )


def use_fake_quant(model: nn.Module, policy: QuantizingPolicy) -> nn.Module:
    """Swaps every linear layer `policy.quantizes` for a FakeQuantLinear, in place."""
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            name = f"{prefix}.{child_name}.weight".lstrip(".")
            if is_plain_linear(child) and policy.quantizes(name, child.weight):
                setattr(module, child_name, FakeQuantLinear(child, name, policy))
    return model
