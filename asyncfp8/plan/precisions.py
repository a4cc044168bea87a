"""The rollout precisions the planner prices, read from each policy's own storage.

A precision is an asyncfp8 precision policy (built-in or a registered plugin); what it
stores and computes in comes from `policy.storage()` (asyncfp8/precision/storage.py), so
the byte counts are what the policies export (checked in tests/test_plan.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from asyncfp8.precision import get_policy
from asyncfp8.precision.storage import Storage

from .errors import PlanInputError

#: `mixed_int8@0.67`: precision=mixed over INT8 with 67% of the linear FLOPs quantized
#: (the share a measured layout reports: RUN_DIR/precision_layout.json, docs/precision.md)
MIXED = re.compile(r"mixed_(\w+)@([0-9.]+)")
#: `fp8@float32`: the engine computing in that dtype around the format's GEMMs
#: (`precision.engine_dtype`; docs/precision.md, "The engine's compute dtype")
ENGINE_DTYPE = re.compile(r"(.+)@(bfloat16|float16|float32)")


@dataclass(frozen=True)
class Precision:
    name: str
    storage: Storage
    #: the share of the linear layers (FLOPs and weights alike) in the quantized format;
    #: the rest run unquantized (a mixed layout priced as its two parts)
    quantized_share: float = 1.0

    @property
    def weights(self) -> str:
        """The linear layers' GEMM type: bf16, fp8 or int8 (a GPU's peak rate)."""
        return self.storage.compute

    @property
    def kv(self) -> str:
        """KV-cache storage: bf16 or fp8."""
        return self.storage.kv_cache

    @property
    def kv_bytes_per_element(self) -> int:
        return self.storage.kv_dtype.itemsize

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation, and of an unquantized weight (embeddings, LM head)."""
        return self.storage.activation_dtype.itemsize

    def scale_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the scales stored beside one quantized weight [out, in]."""
        return self.storage.scale_bytes(out_features, in_features)

    def linear_bytes(self, out_features: int, in_features: int) -> float:
        """Bytes of one linear weight as the engine holds it (scales included); of a mixed
        layout, its quantized share at the format's size and the rest unquantized."""
        quantized = self.storage.linear_bytes(out_features, in_features)
        if self.quantized_share == 1:
            return quantized
        plain = out_features * in_features * self.activation_bytes
        return self.quantized_share * quantized + (1 - self.quantized_share) * plain

    def unquantized(self) -> Precision:
        """The same precision with every linear layer unquantized, in the engine's dtype (the
        KV cache kept)."""
        dtype = self.storage.activation_dtype
        kept = Storage(weight_dtype=dtype, kv_dtype=self.storage.kv_dtype, activation_dtype=dtype)
        return Precision(f"{self.name} (unquantized part)", kept)


def get_precision(name: str) -> Precision:
    """The precision of policy `name` (registered, or composed with '+'), with its
    default parameters; `mixed_<base>@<share>` is `base` on that share of the linear
    layers and BF16 on the rest; `<name>@<dtype>` the engine computing in that dtype
    (refused for a mixed layout, as `precision=mixed` refuses it)."""
    computing = ENGINE_DTYPE.fullmatch(name)
    if computing:
        dtype = getattr(torch, computing.group(2))
        if MIXED.fullmatch(computing.group(1)):
            if dtype != torch.bfloat16:
                raise PlanInputError(
                    f"precision {name!r}: precision=mixed measures its layout against a BF16 "
                    "engine and runs with one only (precision.engine_dtype)"
                )
            return get_precision(computing.group(1))
        base = get_precision(computing.group(1))
        try:  # refuses what the policy refuses (fp16 in another dtype)
            get_policy(computing.group(1)).set_engine_dtype(dtype)
        except (KeyError, ValueError) as err:
            raise PlanInputError(f"precision {name!r}: {err}") from None
        return Precision(name, base.storage.computing_in(dtype), base.quantized_share)
    mixed = MIXED.fullmatch(name)
    if mixed:
        base, share = get_precision(mixed.group(1)), float(mixed.group(2))
        if base.weights == "bf16" or not 0 < share <= 1:
            raise PlanInputError(
                f"precision {name!r}: mixed_<base>@<share> takes a quantizing base (fp8, int8) "
                f"and a share in (0, 1], got {mixed.group(1)!r} and {share}"
            )
        return Precision(name, base.storage, share)
    try:
        policy = get_policy(name)
    except (KeyError, ValueError) as err:
        raise PlanInputError(f"precision {name!r}: {err}") from None
    return Precision(name, policy.storage())
