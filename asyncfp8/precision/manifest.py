"""The typed manifest of a version: what each tensor is, and the one check of a received
version that every engine runs. Each tensor's `TensorRole` (its role, decoder layer and
q/k/v part) is set by the policy and read by receivers: nothing parses a tensor's name.
`check_received` checks a version whole against the `TensorSpec`s an engine declared at
start, before any of it is written (docs/precision.md, "The lifecycle")."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


class Role(enum.StrEnum):
    WEIGHT = "weight"  # a model parameter as the engine runs it (quantized or passed through)
    WEIGHT_SCALE = "weight_scale"  # a quantized weight's scale (block or per-channel)
    KV_SCALE = "kv_scale"  # one layer's q, k or v scale of an FP8 KV cache (0-dim FP32)
    PROBE = "probe"  # the refit probe's sequences and reference values (asyncfp8.refit)
    EXTRA = "extra"  # any other per-version tensor a user's policy calibrates


#: Roles that travel in a version's `weights` section; all others are `extra`.
WEIGHT_ROLES = frozenset({Role.WEIGHT, Role.WEIGHT_SCALE})
KV_PARTS = ("q", "k", "v")


@dataclass(frozen=True)
class TensorRole:
    role: Role
    layer: int | None = None  # the decoder layer, None for the embeddings, final norm, head
    part: str | None = None  # "q", "k" or "v" for a KV scale

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        if self.layer is not None and (isinstance(self.layer, bool) or self.layer < 0):
            raise ValueError(f"a tensor's layer is an index >= 0 or None, got {self.layer!r}")
        if (self.part is not None) != (self.role is Role.KV_SCALE) or (
            self.part is not None and self.part not in KV_PARTS
        ):
            raise ValueError(
                f"a {self.role.value} tensor's part is "
                + ("one of q, k, v" if self.role is Role.KV_SCALE else "None")
                + f", got {self.part!r}"
            )
        if self.role is Role.KV_SCALE and self.layer is None:
            raise ValueError("a KV scale belongs to a layer")

    @property
    def section(self) -> str:
        """The version section it travels in: "weights" or "extra"."""
        return "weights" if self.role in WEIGHT_ROLES else "extra"

    def wire(self) -> dict[str, Any]:
        """The header fields that carry it (msgpack-able)."""
        return {"role": self.role.value, "layer": self.layer, "kv_part": self.part}

    @classmethod
    def from_wire(cls, entry: Mapping[str, Any]) -> TensorRole:
        """The role a header entry carries; ValueError for one that is malformed."""
        role, layer, part = entry.get("role"), entry.get("layer"), entry.get("kv_part")
        if not isinstance(role, str) or role not in {r.value for r in Role}:
            raise ValueError(f"unknown role {role!r} (expected one of {[r.value for r in Role]})")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise ValueError(f"layer {layer!r} is not an integer")
        return cls(Role(role), layer, part)


#: The header fields of an entry that `wire` writes.
WIRE_KEYS = ("role", "layer", "kv_part")
WEIGHT = TensorRole(Role.WEIGHT)
EXTRA = TensorRole(Role.EXTRA)


def default_role(section: str) -> TensorRole:
    """The role of a tensor sent without one: a weight, or an unspecified extra tensor."""
    return WEIGHT if section == "weights" else EXTRA


def decoder_layers(model: torch.nn.Module) -> dict[str, int]:
    """{parameter name: decoder layer index} for a transformers causal LM, read from its
    module tree (the decoder's `layers` list), not from the names."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return {}
    prefix = next((name for name, module in model.named_modules() if module is layers), None)
    if prefix is None:
        return {}
    return {
        f"{prefix}.{index}.{name}": index
        for index, layer in enumerate(layers)
        for name, _ in layer.named_parameters()
    }


@dataclass(frozen=True)
class TensorSpec:
    """What an engine holds for one tensor of a version. A KV scale's shape and dtype are
    free (any one finite positive floating-point value); `role` None takes either weight
    role (an adapter that knows its checkpoint's tensors, not which is a scale)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    role: TensorRole | None = None

    @property
    def required(self) -> bool:
        """Whether every version with weights must bring it (weights are applied whole)."""
        return self.role is None or self.role.section == "weights"


def kv_scale_specs(roles: Mapping[str, TensorRole]) -> dict[str, TensorSpec]:
    """TensorSpecs for the KV scales among `roles` (a policy's `extra_roles()`)."""
    return {
        name: TensorSpec((), torch.float32, role)
        for name, role in roles.items()
        if role.role is Role.KV_SCALE
    }


def check_received(
    version: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    manifest: Mapping[str, TensorRole] | None,
    expected: Mapping[str, TensorSpec],
) -> dict[str, TensorRole]:
    """Refuses (ValueError naming the tensor) a version with an unknown tensor, a role
    other than the one the engine holds there, a wrong shape or dtype, a KV scale that is
    not one finite value > 0, or (unless it has no weights at all) a missing weight.
    `manifest` is the version's header (None: a version handed over in process, whose
    roles are the engine's own). Returns each tensor's role."""
    roles: dict[str, TensorRole] = {}
    for name, tensor in tensors:
        spec = expected.get(name)
        if spec is None:
            raise ValueError(
                f"version {version}: unknown tensor {name!r} (do the learner and this worker "
                "use the same model and precision? A policy's calibrated tensors need their "
                "roles in extra_roles())"
            )
        sent = None if manifest is None else manifest.get(name)
        if manifest is not None and sent is None:
            raise ValueError(f"version {version}: {name} has no role in the version's manifest")
        if sent == EXTRA and spec.role is not None and spec.role.section == "extra":
            raise ValueError(
                f"version {version}: extra tensor {name} was sent without a role: a policy "
                "names the roles of what its calibrate() returns in extra_roles()"
            )
        holds_weight = spec.role is None or spec.role.section == "weights"
        fits = (
            sent is None
            or (sent == WEIGHT and holds_weight)  # sent without a role: any weight role fits
            or (sent == spec.role if spec.role is not None else sent.section == "weights")
        )
        if not fits:
            raise ValueError(
                f"version {version}: {name} is sent as {sent}, this engine holds it as "
                f"{spec.role or 'a weight'}"
            )
        role = spec.role or sent or WEIGHT
        if role.role is Role.KV_SCALE:
            _check_scale_value(version, name, tensor)
        elif (tuple(tensor.shape), tensor.dtype) != (spec.shape, spec.dtype):
            raise ValueError(
                f"version {version}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                f"engine's {spec.shape} {spec.dtype} (do the learner and this worker use the "
                "same model and precision?)"
            )
        roles[name] = role
    missing = [name for name, spec in expected.items() if spec.required and name not in roles]
    if missing and any(role.section == "weights" for role in roles.values()):
        raise ValueError(
            f"version {version} lacks {len(missing)} of the engine's weights (first: "
            f"{missing[0]}); a version is applied whole"
        )
    return roles


def _check_scale_value(version: int, name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise ValueError(
            f"version {version}: {name} must be one floating-point value, got "
            f"{tensor.dtype} {tuple(tensor.shape)}"
        )
    value = float(tensor.detach().float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"version {version}: {name} is {value}; a KV scale must be finite and > 0")
