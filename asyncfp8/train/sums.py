"""What a training step adds up, typed: one update's sums over its micro-batches (summed
over ranks before anything reads them), the step's totals over its updates, and the
`StepSums` a step returns, which rank 0's metrics and the guard read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from asyncfp8.run import distributed
from asyncfp8.train.guard import Evidence


@dataclass
class UpdateSums:
    """One update's sums over its micro-batches. The loss of an update is a mean over the
    whole mini-batch: Σ numerators / Σ `denominator`, over micro-batches and ranks."""

    total: float = 0.0  # the loss's numerator: policy, KL and entropy terms
    policy: float = 0.0  # the policy term's numerator alone
    denominator: float = 0.0  # real tokens, or sequences with one (optim.aggregation)

    entropy: float = 0.0  # summed over the kept tokens
    kl: float = 0.0  # KL to the reference, summed over the kept tokens
    kept: float = 0.0  # tokens the correction kept
    real_tokens: float = 0.0
    clipped: float = 0.0  # kept tokens a clip made constant
    router_aux: float = 0.0  # MoE: the load-balancing loss, weighted like `denominator`
    evidence: Evidence = field(default_factory=Evidence)  # the guard's, on the judged update

    def over_ranks(self) -> UpdateSums:
        """These sums added over every rank (a collective: every rank calls it)."""
        flat = _flatten(self)
        return _unflatten(UpdateSums, distributed.sum_over_ranks(flat))


@dataclass
class StepTotals:
    """A step's sums over its updates (each update's `UpdateSums` over ranks, added up),
    and what became of each update."""

    kept: float = 0.0
    real_tokens: float = 0.0
    clipped: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    policy_loss: float = 0.0  # each update's mean policy loss, added up
    total_loss: float = 0.0
    router_aux: float = 0.0  # MoE: each update's mean load-balancing loss, added up
    grad_norm: float = 0.0  # of the updates applied, added up
    updates: int = 0  # applied

    loss_scale_skipped: int = 0  # an FP16 overflow skipped them
    starved_skipped: int = 0  # too little kept evidence skipped them
    starved: int = 0  # shrunk or skipped for too little kept evidence
    update_scale: float = 0.0  # the learning-rate factors of the updates, added up

    # correction.proximal=version: tokens scored under their own version's weights, and
    # those of a version no longer kept (left to the current weights); None otherwise
    proximal_version_tokens: int | None = None
    proximal_fallback_tokens: int | None = None
    proximal_ahead_tokens: int | None = None  # of the version tokens, scored ahead

    @property
    def passes(self) -> int:
        """Updates that measured their loss: applied, or skipped after measuring it."""
        return self.updates + self.loss_scale_skipped + self.starved_skipped

    def add(self, sums: UpdateSums) -> None:
        for name in ("kept", "real_tokens", "clipped", "entropy", "kl"):
            setattr(self, name, getattr(self, name) + getattr(sums, name))
        self.policy_loss += sums.policy / max(sums.denominator, 1.0)
        self.total_loss += sums.total / max(sums.denominator, 1.0)
        self.router_aux += sums.router_aux / max(sums.denominator, 1.0)


@dataclass
class StepSums:
    """What a step returns: per sample, the log-probs the correction saw (every rank's,
    gathered on rank 0); the totals; and the metrics of the guard, the loss scale and the
    rejection bounds."""

    seen: list[dict[int, torch.Tensor]] | None
    totals: StepTotals = field(default_factory=StepTotals)
    seconds: float = 0.0
    rolled_back: bool = False  # the guard undid the previous step; this one trained nothing
    guard: dict[str, float] = field(default_factory=dict)  # guard/* metrics of this step
    loss_scale: dict[str, float] = field(default_factory=dict)  # loss_scale/* (FP16 compute)
    # correction/* of calibrated bounds (the step that set them) and starved updates
    rejection: dict[str, float] = field(default_factory=dict)
    moe: dict[str, float] = field(default_factory=dict)  # moe/* (an MoE model)


def _flatten(sums) -> dict[str, float]:
    flat = {}
    for f in dataclasses.fields(sums):
        value = getattr(sums, f.name)
        if dataclasses.is_dataclass(value):
            flat |= {f"{f.name}.{key}": v for key, v in _flatten(value).items()}
        else:
            flat[f.name] = value
    return flat


def _unflatten(kind, flat: dict[str, float]):
    values, nested = {}, {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            values[head] = value
    types = {f.name: f.default_factory for f in dataclasses.fields(kind) if f.name in nested}
    values |= {name: _unflatten(types[name], part) for name, part in nested.items()}
    return kind(**values)
