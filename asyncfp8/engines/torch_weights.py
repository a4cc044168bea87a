"""Where a version's tensors go in the torch engine's model: the tensors it holds by name,
what a version must hold for it (`specs`, for `check_received`), and a checked version
sorted by destination, which `TorchEngine.update_weights` then copies in place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.manifest import Role, TensorRole, TensorSpec, kv_scale_specs
from asyncfp8.precision.modules import QuantizedLinear


@dataclass
class ModelTensors:
    """`params`: the parameters, and the biases that quantized modules keep as buffers;
    `owners`: every engine-side tensor name a quantized module owns -> that module."""

    params: dict[str, torch.Tensor]
    owners: dict[str, QuantizedLinear]

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelTensors:
        params = dict(model.named_parameters()) | {
            name: buffer for name, buffer in model.named_buffers() if name.endswith(".bias")
        }
        owners = {
            name: module
            for module in model.modules()
            if isinstance(module, QuantizedLinear)
            for name in module.expects
        }
        return cls(params, owners)

    def specs(
        self, policy: PrecisionPolicy, layer_of: Mapping[str, int], fp8_kv: bool
    ) -> dict[str, TensorSpec]:
        """What a version holds for this engine, with each tensor's role: the parameters
        (and the biases quantized modules keep), each quantized module's tensors as the
        policy names their roles, and the KV scales of an e4m3 cache."""
        specs = {
            name: TensorSpec(
                tuple(tensor.shape), tensor.dtype, TensorRole(Role.WEIGHT, layer_of.get(name))
            )
            for name, tensor in self.params.items()
        }
        for module in {id(m): m for m in self.owners.values()}.values():
            source = module.source_name
            for name, (shape, dtype) in module.expects.items():
                role = TensorRole(policy.output_role(source, name), layer_of.get(source))
                specs[name] = TensorSpec(shape, dtype, role)
        if fp8_kv:
            specs |= kv_scale_specs(policy.extra_roles())
        return specs

    def sort(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor],
        roles: Mapping[str, TensorRole],
    ) -> tuple[
        dict[QuantizedLinear, dict[str, torch.Tensor]],
        list[tuple[torch.Tensor, torch.Tensor]],
        dict[tuple[int, str], torch.Tensor],
    ]:
        """A checked version by destination: {quantized module: its tensors}, [(parameter,
        value)] and {(layer, "k" | "v"): the KV scale as a 0-dim fp32 tensor}."""
        params, layers, kv = [], {}, {}
        for name, tensor in named_tensors.items():
            if name in self.owners:
                layers.setdefault(self.owners[name], {})[name] = tensor
            else:
                params.append((self.params[name], tensor))
        for name, tensor in extra.items():
            role = roles[name]
            # A q scale (which vLLM may apply) is taken and not used: queries stay in the
            # model dtype here.
            if role.role is Role.KV_SCALE and role.part != "q":
                kv[(role.layer, role.part)] = tensor.detach().float().reshape(())
        return layers, params, kv
