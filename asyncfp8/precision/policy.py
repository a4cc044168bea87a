"""PrecisionPolicy: how the learner's weights become what a rollout engine runs.

In the spirit of vLLM's `QuantizationConfig`: a small object with a narrow lifecycle.
At start, `engine_config()` says how the engine must be built; every version,
`quantize_weights()` streams the learner's (name, tensor) pairs through the policy one
at a time (the quantized model is never held whole), and `calibrate()` adds the extra
tensors the version needs (KV-cache scales). Policies compose with "+":
`fp8+fp8_kv` is FP8 weights and an FP8 KV cache.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]

# Left in the training dtype by every weight quantizer: embeddings, the LM head, norms,
# biases (1-D anyway) and MoE routers (`mlp.gate`, not `mlp.gate_proj`).
UNQUANTIZED = re.compile(r"(embed|lm_head|norm|\.mlp\.gate\.weight$|\.bias$)")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's 2-D weight that W8A8 quantizers turn into 8 bits."""
    return name.endswith(".weight") and tensor.dim() == 2 and not UNQUANTIZED.search(name)


def check_weight(name: str, tensor: torch.Tensor) -> None:
    """The errors a quantizer must raise rather than produce garbage (or hide a NaN)."""
    if tensor.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {tensor.dtype}")
    finite = torch.isfinite(tensor)
    if not finite.all():
        bad = (~finite).nonzero()[0].tolist()
        kind = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise ValueError(
            f"{name}: {(~finite).sum().item()} non-finite values ({kind}, first at {bad}); refusing to quantize"
        )


class PrecisionPolicy:
    """Base class: the identity policy. Subclasses override what they change."""

    name: str = "base"
    #: True if `quantize_weights` changes weights (at most one such part per composition).
    quantizes_weights: bool = False
    #: True if `calibrate` returns tensors every version needs (KV-cache scales).
    needs_calibration: bool = False

    def engine_config(self) -> dict[str, Any]:
        """What the rollout engine must be started with: `dtype`, `quantization`,
        `quantization_config` (HF config.json form), `kv_cache_dtype`, ..."""
        return {}

    def quantize_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine-side tensors for one learner tensor (one or several, e.g. a
        weight and its scale). Called only for tensors `is_quantizable` accepts."""
        yield name, tensor

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the policy does not quantize, as the engine gets it."""
        return tensor

    def quantize_weights(self, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Streams (name, tensor) pairs through the policy, one learner tensor at a time."""
        for name, tensor in named_tensors:
            if self.quantizes_weights and is_quantizable(name, tensor):
                yield from self.quantize_tensor(name, tensor)
            else:
                yield name, self.passthrough(name, tensor)

    def calibrate(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Extra tensors for this version (e.g. KV-cache scales); none by default."""
        return {}

    def checkpoint_config(self) -> dict[str, Any] | None:
        """The `quantization_config` an exported checkpoint's config.json carries."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ComposedPolicy(PrecisionPolicy):
    """Several policies applied together, e.g. FP8 weights + FP8 KV cache."""

    def __init__(self, parts: list[PrecisionPolicy]):
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"precision {'+'.join(names)!r} names a policy twice")
        weight_parts = [p.name for p in parts if p.quantizes_weights]
        if len(weight_parts) > 1:
            raise ValueError(
                f"precision {'+'.join(names)!r} makes no sense: {' and '.join(weight_parts)} both "
                "quantize the weights; compose one weight format with KV-cache policies"
            )
        config: dict[str, Any] = {}
        for part in parts:
            for key, value in part.engine_config().items():
                if key in config and config[key] != value:
                    raise ValueError(
                        f"precision {'+'.join(names)!r}: {key!r} is {config[key]!r} in one part and {value!r} in another"
                    )
                config[key] = value
        self.parts, self.name, self._engine_config = parts, "+".join(names), config
        self._weights = next((p for p in parts if p.quantizes_weights), parts[0])
        self.quantizes_weights = self._weights.quantizes_weights
        self.needs_calibration = any(p.needs_calibration for p in parts)

    def engine_config(self) -> dict[str, Any]:
        return dict(self._engine_config)

    def quantize_tensor(self, name, tensor):
        return self._weights.quantize_tensor(name, tensor)

    def passthrough(self, name, tensor):
        return self._weights.passthrough(name, tensor)

    def calibrate(self, model, batch):
        extra: dict[str, torch.Tensor] = {}
        for part in self.parts:
            extra |= part.calibrate(model, batch)
        return extra

    def checkpoint_config(self):
        """The weight format's config, plus what lets the engine load KV scales:
        compressed-tensors (INT8) takes a `kv_cache_scheme`; blockwise FP8's own config
        already loads `k_scale` / `v_scale`; BF16 weights take the KV part's config."""
        config = self._weights.checkpoint_config() if self._weights.quantizes_weights else None
        kv = next(
            (
                p.checkpoint_config()
                for p in self.parts
                if p.needs_calibration and p.checkpoint_config()
            ),
            None,
        )
        if kv is None:
            return config
        if config is None:
            return kv
        if config.get("quant_method") == "compressed-tensors":
            return {**config, "kv_cache_scheme": kv["kv_cache_scheme"]}
        return config


_POLICIES: dict[str, Callable[..., PrecisionPolicy]] = {}


def register_policy(name: str, factory: Callable[..., PrecisionPolicy] | None = None):
    """Register a PrecisionPolicy subclass (or any factory of one) under `name`;
    usable as a class decorator."""

    def add(fn):
        if "+" in name:
            raise ValueError(f"policy names cannot contain '+' (it composes policies): {name!r}")
        if name in _POLICIES and _POLICIES[name] is not fn:
            raise ValueError(f"a precision policy named {name!r} is already registered")
        _POLICIES[name] = fn
        return fn

    return add(factory) if factory is not None else add


def registered_policies() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str, **params: Any) -> PrecisionPolicy:
    """`get_policy("fp8")`, `get_policy("fp8+fp8_kv", margin=1.1)`. Parameters go to
    every part that accepts them; one no part accepts is an error."""
    parts_names = [part.strip() for part in name.split("+")]
    unknown = [n for n in parts_names if n not in _POLICIES]
    if unknown or not all(parts_names):
        raise ValueError(
            f"unknown precision policy {name!r}; registered: {', '.join(registered_policies())} "
            "(compose with '+', e.g. 'fp8+fp8_kv')"
        )
    import inspect

    parts, used = [], set()
    for part_name in parts_names:
        factory = _POLICIES[part_name]
        accepted = set(inspect.signature(factory).parameters)
        mine = {k: v for k, v in params.items() if k in accepted}
        used |= set(mine)
        parts.append(factory(**mine))
    unused = sorted(set(params) - used)
    if unused:
        raise ValueError(f"precision {name!r} takes no parameter(s) {unused}")
    return parts[0] if len(parts) == 1 else ComposedPolicy(parts)


def build_policy(cfg: Mapping[str, Any]) -> PrecisionPolicy:
    """A policy from its `precision=` config entry: `name` plus parameters."""
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    if "name" not in params:
        raise ValueError(f"precision config needs a 'name'; got keys {sorted(params)}")
    return get_policy(params.pop("name"), **params)


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
