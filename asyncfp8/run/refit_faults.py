"""Refit faults: a worker damages the first version numbered N or more it applies, once, so the
reliability suite can show that the refit probe catches it (docs/reliability.md, 'Refit
faults'); the snapshot it then asks for arrives intact. Kinds: `KINDS`.

    ASYNCFP8_REFIT_FAULT=kv_scales_dropped@3 python -m asyncfp8.worker ...
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
