"""Refit faults: a worker that damages one version on its way into the engine, as
refits of other RL stacks have (REFERENCES.md), for the reliability suite to show that
the refit probe (asyncfp8/refit/probe.py) catches each at the version it happens.

    ASYNCFP8_REFIT_FAULT=kv_scales_dropped@3 python -m asyncfp8.worker ...

damages version 3 (the first version numbered 3 or more that this worker applies) once;
the snapshot the worker then asks for arrives intact, so a caught fault costs one
snapshot and no samples. Faults:

- kv_scales_dropped: the version's KV scales never reach the cache (it runs with 1.0)
- kv_scales_doubled: every KV scale ×2
- layer_skipped: layer 1 keeps the previous version's tensors (an engine that skipped
  loading it: the version still arrives whole, so only the probe can tell)
- scale_transposed: the first weight scale with two dimensions of 2 or more is read in
  the transposed order (same shape: what a kernel expecting the other layout does)
- nan: one value of one weight tensor is NaN
- stale: the update is not applied at all (the engine stays on the previous version)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping

import torch

from asyncfp8.precision.manifest import Role, TensorRole

ENV = "ASYNCFP8_REFIT_FAULT"
KINDS = (
    "kv_scales_dropped",
    "kv_scales_doubled",
    "layer_skipped",
    "scale_transposed",
    "nan",
    "stale",
)
log = logging.getLogger("asyncfp8.chaos")


class RefitFault:
    def __init__(self, kind: str, at: int):
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; known: {', '.join(KINDS)}")
        self.kind, self.at, self.done = kind, at, False
        self.version: int | None = None  # the version it damaged
        self.previous_layer: dict[str, torch.Tensor] = {}  # layer_skipped: what layer 1 held

    @classmethod
    def from_env(cls) -> RefitFault | None:
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        kind, _, at = spec.partition("@")
        if not at.isdigit():
            raise ValueError(f"{ENV}: expected kind@version, got {spec!r}")
        return cls(kind, int(at))

    def _due(self, version: int) -> bool:
        return not self.done and version >= self.at

    def skips_update(self, version: int) -> bool:
        if self.kind == "stale" and self._due(version) and version > 0:
            self._fired(version)
            return True
        return False

    def tamper(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor],
        manifest: Mapping[str, TensorRole],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        weights, extra = dict(weights), dict(extra)
        if (
            self.kind == "layer_skipped"
            and not self.done
            and not (self._due(version) and self.previous_layer)
        ):
            # Layer 1 as this version has it, for the next version to keep (copies: a
            # subscriber reuses its buffers); the fault fires at the first due version
            # that has an earlier one.
            self.previous_layer = {
                k: v.clone() for k, v in weights.items() if manifest[k].layer == 1
            }
            return weights, extra
        if self.kind == "stale" or not self._due(version):
            return weights, extra
        kv = [name for name in extra if manifest[name].role is Role.KV_SCALE]
        if self.kind == "kv_scales_dropped":
            if not kv:
                raise ValueError(f"{ENV}: {self.kind} needs a precision with KV scales")
            extra |= {name: torch.ones_like(extra[name]) for name in kv}
        elif self.kind == "kv_scales_doubled":
            if not kv:
                raise ValueError(f"{ENV}: {self.kind} needs a precision with KV scales")
            extra |= {name: extra[name] * 2 for name in kv}
        elif self.kind == "layer_skipped":
            weights |= self.previous_layer
        elif self.kind == "scale_transposed":
            name = next(
                (
                    k
                    for k, v in weights.items()
                    if manifest[k].role is Role.WEIGHT_SCALE and v.dim() == 2 and min(v.shape) >= 2
                ),
                None,
            )
            if name is None:
                raise ValueError(
                    f"{ENV}: {self.kind} needs a weight scale of at least 2x2 (FP8 blocks of "
                    "a model with 256+ wide layers)"
                )
            scale = weights[name]
            weights[name] = scale.t().contiguous().reshape(scale.shape)
        elif self.kind == "nan":
            name = next(
                k
                for k, v in weights.items()
                if manifest[k].layer is not None and v.is_floating_point() and v.dim() == 2
            )
            damaged = weights[name].clone()
            damaged.view(-1)[0] = math.nan
            weights[name] = damaged
        self._fired(version)
        return weights, extra

    def _fired(self, version: int) -> None:
        self.done, self.version = True, version
        log.warning("refit fault %s injected into version %d", self.kind, version)
