"""π_prox of the sample's own version (`correction.proximal=version`, or `auto` where it can):
the learner keeps its unquantized weights of the versions it published, as far back as the
staleness bound reaches, and scores each stale token under its version's weights, so the
correction sees the precision mismatch alone. Cost: 4 bytes a parameter of host memory per
kept version, plus one for the swap, and a no-grad forward per stale version a step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.run.distributed import local_shard, resharded

# auto keeps versions only where their copies take at most this share of the host memory
# available at start: the rest is the engine's, the data's and the checkpoint writer's.
AUTO_MEMORY_SHARE = 0.5


def kept_bytes(parameters: int, keep: int) -> int:
    """Host memory `VersionWeights` takes: FP32 copies of `keep` versions, one for swaps."""
    return 4 * parameters * (keep + 1)


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def choose_proximal(
    asked: str, mode: str, ranks: int, parameters: int, keep: int, available: int | None
) -> tuple[str, str]:
    """`correction.proximal` resolved to `current` or `version`, and why. `auto` (the
    default) is `version` where the learner can keep the versions: decoupled mode (bypass
    has no π_prox), one learner rank (each rank would swap in other versions), and copies
    that take at most AUTO_MEMORY_SHARE of the available host memory. It learns better:
    docs/correction.md#decoupled-or-bypass."""
    if asked != "auto":
        return asked, "correction.proximal=" + asked
    if mode == "bypass":
        return "current", "auto: bypass mode has no π_prox"
    if ranks > 1:
        return "current", f"auto: {ranks} learner ranks (versions are kept on one rank only)"
    need = kept_bytes(parameters, keep)
    if available is not None and need > AUTO_MEMORY_SHARE * available:
        return "current", (
            f"auto: keeping {keep} versions takes {need / 2**30:.1f} GiB of host memory, more "
            f"than {AUTO_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available "
            "(correction.proximal=version insists)"
        )
    return "version", f"auto: {keep} versions kept, {need / 2**20:.1f} MiB of host memory"


class VersionWeights:
    """The learner's weights of recent versions, on the CPU; `live` is the version the
    model's own weights are (None once a step has changed them since)."""

    def __init__(self, model: torch.nn.Module, keep: int, policy: PrecisionPolicy | None = None):
        self.model, self.keep, self.policy = model, keep, policy
        self.weights: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        #: each kept version's `policy.learner_state()` (its FP8 KV scales)
        self.states: dict[int, dict] = {}
        self.live: int | None = None
        self._scratch: list[torch.Tensor] = []
        #: held while a version's copies are written or read (the proximal thread reads them)
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        tensors = [t for ts in self.weights.values() for t in ts] + self._scratch
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def record(self, version: int) -> None:
        """The model's weights are `version` now (it was just published)."""
        with self.lock:
            full = len(self.weights) >= self.keep
            reused = self.weights.popitem(last=False)[1] if full else None
            params = self._params()
            copies = reused or [torch.empty_like(local_shard(p), device="cpu") for p in params]
            for copy, p in zip(copies, params, strict=True):
                copy.copy_(local_shard(p.detach()))
            self.weights[version] = copies
            if self.policy is not None:
                self.states = {v: s for v, s in self.states.items() if v in self.weights}
                self.states[version] = self.policy.learner_state()
        self.live = version

    def changed(self) -> None:
        """A step has updated the model: it is no version any more."""
        self.live = None

    def has(self, version: int) -> bool:
        return version in self.weights

    @contextmanager
    def swapped_in(self, version: int):
        """The model with the weights of `version` for the duration, its own after. Both
        swaps write FSDP2's sharded parameters, resharded first: a no-grad forward leaves
        the root unit (embeddings, final norm, LM head) unsharded and the next forward uses
        that copy, so a swap of the shards alone leaves the root on the other version, and
        a swap of the copy alone is lost at the next reshard. (The policy's KV scales too.)"""
        params = self._params()
        if not self._scratch:
            self._scratch = [torch.empty_like(local_shard(p), device="cpu") for p in params]
        with torch.no_grad():
            for scratch, p, saved in zip(self._scratch, params, self.weights[version], strict=True):
                scratch.copy_(local_shard(p.detach()))
                local_shard(p.data).copy_(saved)
        own_state = self.policy.learner_state() if self.policy is not None else None
        if own_state is not None and version in self.states:
            self.policy.load_learner_state(self.states[version])
        try:
            yield
        finally:
            with torch.no_grad():
                for scratch, p in zip(self._scratch, self._params(), strict=True):
                    local_shard(p.data).copy_(scratch)
            if own_state is not None:
                self.policy.load_learner_state(own_state)

    def _params(self) -> list[torch.Tensor]:
        return list(resharded(self.model).parameters())
