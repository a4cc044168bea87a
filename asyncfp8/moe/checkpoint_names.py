"""An MoE's experts under a checkpoint's names. The learner holds each layer's experts
fused, as transformers 5 loads Qwen3-MoE (`mlp.experts.gate_up_proj` [experts, 2·I, H],
gate rows first, and `mlp.experts.down_proj` [experts, H, I]); a checkpoint, and the
vLLM model loaded from one, names each expert's linears (`mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`), as `save_pretrained` writes them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

import torch

_FUSED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
Role = TypeVar("Role")


def expert_parts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The per-expert checkpoint tensors (views, no copy) of a fused expert tensor; None
    for any other tensor."""
    match = _FUSED.match(name)
    if match is None:
        return None
    experts, count = match["experts"], tensor.shape[0]
    if match["kind"] == "down_proj":
        return [(f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(count)]
    half = tensor.shape[1] // 2
    return [
        part
        for e in range(count)
        for part in (
            (f"{experts}.{e}.gate_proj.weight", tensor[e, :half]),
            (f"{experts}.{e}.up_proj.weight", tensor[e, half:]),
        )
    ]


def checkpoint_named(
    named: Mapping[str, torch.Tensor], roles: Mapping[str, Role] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Role] | None]:
    """`named` with every fused expert tensor split into its checkpoint names, and `roles`
    (a version's manifest, None: none) with each part in its fused tensor's role. A dense
    model's tensors pass unchanged."""
    tensors: dict[str, torch.Tensor] = {}
    split_roles = None if roles is None else dict(roles)
    for name, tensor in named.items():
        parts = expert_parts(name, tensor)
        if parts is None:
            tensors[name] = tensor
            continue
        tensors.update(parts)
        if split_roles is not None and name in split_roles:
            role = split_roles.pop(name)
            split_roles.update((part, role) for part, _ in parts)
    return tensors, split_roles
