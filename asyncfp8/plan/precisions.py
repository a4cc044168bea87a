"""The rollout precisions the planner prices, read from each policy's own storage.

A precision is an asyncfp8 precision policy (asyncfp8/precision/), a built-in one or a
registered plugin; what it stores and computes in comes from `policy.storage()`
(asyncfp8/precision/storage.py), the format's own description, so the byte counts here
are what the policies export (checked in tests/test_plan.py against
`policy.quantize_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncfp8.precision import get_policy
from asyncfp8.precision.storage import Storage

from .errors import PlanInputError


@dataclass(frozen=True)
class Precision:
    name: str
    storage: Storage

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

    def scale_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the scales stored beside one quantized weight [out, in]."""
        return self.storage.scale_bytes(out_features, in_features)

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one linear weight as the engine holds it (scales included)."""
        return self.storage.linear_bytes(out_features, in_features)


def get_precision(name: str) -> Precision:
    """The precision of policy `name` (registered, or composed with '+'), with its
    default parameters."""
    try:
        policy = get_policy(name)
    except (KeyError, ValueError) as err:
        raise PlanInputError(f"precision {name!r}: {err}") from None
    return Precision(name, policy.storage())
