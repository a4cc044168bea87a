"""π_prox of the sample's own version (`correction.proximal=version`): the learner keeps
its unquantized weights of the versions it published, as far back as the staleness bound
reaches, and recomputes each stale token's log-probability under the weights of the
version that sampled it.

Then the correction sees π_prox(version v) against the engine's π_rollout(version v):
the precision mismatch alone. The PPO ratio π_θ / π_prox bounds the staleness (the
policy's move since version v) by its clip. With `correction.proximal=current` (the
default) π_prox is the learner's current weights and the correction sees both at once.

Cost: 4 bytes a parameter of host memory per kept version (FP32 weights of the last
`run.max_staleness` + 1 published: with `sync.every` > 1 the newest is not the model's
own weights), one more for the swap, and per step one forward (no gradient) of the
micro-batches holding a stale token, per stale version.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from .rollback import local_shard


class VersionWeights:
    """The learner's weights of recent versions, on the CPU; `live` is the version the
    model's own weights are (None once a step has changed them since)."""

    def __init__(self, model: torch.nn.Module, keep: int):
        self.model, self.keep = model, keep
        self.weights: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self.live: int | None = None
        self._scratch: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        tensors = [t for ts in self.weights.values() for t in ts] + self._scratch
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def record(self, version: int) -> None:
        """The model's weights are `version` now (it was just published)."""
        reused = self.weights.popitem(last=False)[1] if len(self.weights) >= self.keep else None
        copies = reused or [torch.empty_like(local_shard(p), device="cpu") for p in self._params()]
        for copy, p in zip(copies, self._params(), strict=True):
            copy.copy_(local_shard(p.detach()))
        self.weights[version] = copies
        self.live = version

    def changed(self) -> None:
        """A step has updated the model: it is no version any more."""
        self.live = None

    def has(self, version: int) -> bool:
        return version in self.weights

    @contextmanager
    def swapped_in(self, version: int):
        """The model with the weights of `version` for the duration, its own after."""
        params = self._params()
        if not self._scratch:
            self._scratch = [torch.empty_like(local_shard(p), device="cpu") for p in params]
        with torch.no_grad():
            for scratch, p, saved in zip(self._scratch, params, self.weights[version], strict=True):
                scratch.copy_(local_shard(p.detach()))
                local_shard(p.data).copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for scratch, p in zip(self._scratch, params, strict=True):
                    local_shard(p.data).copy_(scratch)

    def _params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())
