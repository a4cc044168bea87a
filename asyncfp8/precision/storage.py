"""How a precision stores a model: the one description the planner prices and the docs cite.

A policy's `storage()` says what its versions hold (weight dtype, scale layout, KV dtype) and
its GEMMs' tensor-core type; the planner prices a new format from it, not from a table
elsewhere (`tests/test_plan.py` checks it against the bytes each built-in policy exports)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kernel_support import ceil_div

#: The tensor-core input types the planner knows peak rates for (asyncfp8.plan.gpus); a
#: format that computes in another type is priced at the BF16 rate.
COMPUTE_TYPES = ("bf16", "fp8", "int8")


@dataclass(frozen=True)
class ScaleLayout:
    """One scale per `rows` x `cols` block of a [out, in] weight; `cols=None` means one
    per `rows` whole rows (per output channel when rows = 1)."""

    rows: int
    cols: int | None
    dtype: torch.dtype = torch.float32

    def shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        cols = 1 if self.cols is None else ceil_div(in_features, self.cols)
        return ceil_div(out_features, self.rows), cols


@dataclass(frozen=True)
class Storage:
    """What a version of one precision holds, per quantized linear weight and per KV entry."""

    #: the dtype of a quantized linear weight (the model dtype when the policy quantizes none)
    weight_dtype: torch.dtype = torch.bfloat16
    #: the scales stored beside each quantized weight, or None
    scales: ScaleLayout | None = None
    #: the dtype of the KV cache's keys and values
    kv_dtype: torch.dtype = torch.bfloat16
    #: the tensor-core type the linear layers' GEMMs run in (one of COMPUTE_TYPES)
    compute: str = "bf16"
    #: what the engine computes in around the GEMMs and keeps unquantized tensors in
    #: (embeddings, norms, LM head): `precision.engine_dtype`
    activation_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.compute not in COMPUTE_TYPES:
            raise ValueError(
                f"Storage.compute must be one of {', '.join(COMPUTE_TYPES)}, got {self.compute!r}"
            )

    @property
    def kv_cache(self) -> str:
        """ "fp8" for a one-byte float KV cache, else "bf16" (the planner's attention kinds)."""
        return "fp8" if self.kv_dtype.itemsize == 1 and self.kv_dtype.is_floating_point else "bf16"

    def scale_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of the scales stored beside one quantized weight [out, in]."""
        if self.scales is None:
            return 0
        rows, cols = self.scales.shape(out_features, in_features)
        return rows * cols * self.scales.dtype.itemsize

    def linear_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one linear weight as the engine holds it, scales included."""
        return out_features * in_features * self.weight_dtype.itemsize + self.scale_bytes(
            out_features, in_features
        )

    def with_kv(self, other: Storage) -> Storage:
        """This storage's weights with `other`'s KV cache (a composition's parts)."""
        return replace(self, kv_dtype=other.kv_dtype)

    def computing_in(self, dtype: torch.dtype) -> Storage:
        """This storage with activations, unquantized weights and a 16-bit KV cache in
        `dtype` (an engine computing in it); a one-byte KV cache and weights stay."""
        kv = self.kv_dtype if self.kv_dtype.itemsize == 1 else dtype
        weights = self.weight_dtype if self.scales is not None else dtype
        return replace(self, weight_dtype=weights, kv_dtype=kv, activation_dtype=dtype)
