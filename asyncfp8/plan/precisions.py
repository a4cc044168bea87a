"""The rollout precisions the planner prices, and what each stores and computes in.

The names are asyncfp8's precision policies (asyncfp8/precision/): the formats are
DESIGN.md §4's, so the byte counts here equal what the policies export (checked in
tests/test_plan.py against `policy.quantize_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanInputError

FP8_BLOCK = 128  # blockwise FP8: one fp32 scale per 128 x 128 block of a weight
SCALE_BYTES = 4  # fp32 scales


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Precision:
    name: str
    weights: str  # storage and GEMM input type of the linear layers: bf16, fp8 or int8
    kv: str  # KV-cache storage: bf16 or fp8

    @property
    def weight_bytes_per_element(self) -> int:
        return 2 if self.weights == "bf16" else 1

    @property
    def kv_bytes_per_element(self) -> int:
        return 2 if self.kv == "bf16" else 1

    def scale_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the scales stored beside one quantized weight [out, in]."""
        if self.weights == "fp8":
            blocks = _ceil_div(out_features, FP8_BLOCK) * _ceil_div(in_features, FP8_BLOCK)
            return blocks * SCALE_BYTES
        if self.weights == "int8":
            return out_features * SCALE_BYTES  # one per output channel
        return 0

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one linear weight as the engine holds it (scales included)."""
        return out_features * in_features * self.weight_bytes_per_element + self.scale_bytes(
            out_features, in_features
        )


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("bf16", weights="bf16", kv="bf16"),
        Precision("fp8", weights="fp8", kv="bf16"),
        Precision("fp8_kv", weights="bf16", kv="fp8"),
        Precision("fp8+fp8_kv", weights="fp8", kv="fp8"),
        Precision("int8", weights="int8", kv="bf16"),
    )
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise PlanInputError(
            f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}"
        ) from None
