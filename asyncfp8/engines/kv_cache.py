"""An FP8 (e4m3) KV cache for transformers models, with per-layer scales.

Keys and values are stored as round(x / scale) in float8_e4m3fn and read back as
q · scale, so attention sees exactly what an engine with an FP8 KV cache sees. The
scales are the version's recalibrated `k_scale` / `v_scale` (asyncfp8.precision.fp8_kv).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from asyncfp8.precision.fp8 import FP8_MAX


class FP8KVLayer(DynamicLayer):
    def __init__(self, k_scale: float, v_scale: float):
        super().__init__()
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.empty(
            (*key_states.shape[:2], 0, key_states.shape[3]),
            dtype=torch.float8_e4m3fn,
            device=self.device,
        )
        self.values = torch.empty(
            (*value_states.shape[:2], 0, value_states.shape[3]),
            dtype=torch.float8_e4m3fn,
            device=self.device,
        )
        self.is_initialized = True

    @staticmethod
    def _quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, self._quantize(key_states, self.k_scale)], dim=-2)
        self.values = torch.cat([self.values, self._quantize(value_states, self.v_scale)], dim=-2)
        return (self.keys.float() * self.k_scale).to(self.dtype), (
            self.values.float() * self.v_scale
        ).to(self.dtype)


def fp8_kv_cache(scales: list[tuple[float, float]]) -> Cache:
    """A cache whose layer i stores e4m3 with (k_scale, v_scale) = scales[i]."""
    return Cache(layers=[FP8KVLayer(k, v) for k, v in scales])
