"""Registering corrections, building them from names or Hydra config, and the one
call path every correction goes through (validation, staleness, rejection filters,
metrics)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .base import (
    LOG_RATIO_CLAMP,
    RAW_LOG_RATIO_LIMIT,
    CorrectionBatch,
    CorrectionResult,
    MethodResult,
)
from .calibration import check_rejection_settings
from .methods import (
    KL_ESTIMATORS,
    geo_rs,
    kl_rejection,
    none,
    seq_mis,
    seq_tis,
    stale_tis,
    token_mis,
    token_tis,
)
from .metrics import mismatch_metrics, staleness_metrics, weight_metrics
from .schema import REJECTION_KEYS, CorrectionConfig

Method = Callable[..., MethodResult]
_METHODS: dict[str, Method] = {}


def register_correction(name: str, method: Method | None = None):
    """Register `method(batch: CorrectionBatch, **params) -> MethodResult` under `name`;
    usable as a decorator. Its keyword defaults are the parameters users can set."""

    def add(fn: Method) -> Method:
        if name in _METHODS and _METHODS[name] is not fn:
            raise ValueError(f"a correction named {name!r} is already registered")
        _METHODS[name] = fn
        return fn

    return add(method) if method is not None else add


def registered_corrections() -> list[str]:
    return sorted(_METHODS)


def registered_methods() -> dict[str, Method]:
    """{name: method} of every registered correction (the config schemas read them)."""
    return dict(_METHODS)


def _bind(name: str, params: Mapping[str, Any]) -> Callable[[CorrectionBatch], MethodResult]:
    if name not in _METHODS:
        raise ValueError(
            f"unknown correction {name!r}; registered: {', '.join(registered_corrections())}"
        )
    method = _METHODS[name]
    accepted = list(inspect.signature(method).parameters)[1:]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"correction {name!r} takes {accepted or 'no parameters'}, not {unknown}")
    # Run once on an empty batch so that bad thresholds fail now, not mid-run.
    empty = torch.zeros(0, 1)
    method(
        CorrectionBatch(empty, empty, empty.bool(), empty, torch.zeros(0, 1, dtype=torch.long), 0),
        **params,
    )
    return lambda batch: method(batch, **params)


class Correction:
    """A configured correction: `corr(learner_logp, rollout_logp, mask, versions=None,
    current_version=None) -> CorrectionResult`. Pure: no state is kept between calls."""

    def __init__(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        reject: Sequence[Mapping[str, Any] | str] = (),
        max_staleness: int | None = None,
    ):
        self.name = name
        self.params = dict(params or {})
        self._method = _bind(name, self.params)
        self.rejections = []
        for entry in reject:
            spec = {"name": entry} if isinstance(entry, str) else dict(entry)
            if "name" not in spec:
                raise ValueError(
                    f"correction {name!r}: each `reject` entry needs a 'name', got {spec}"
                )
            reject_name = spec.pop("name")
            self.rejections.append((reject_name, _bind(reject_name, spec)))
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.max_staleness = max_staleness

    def rebind(self, **params: Any) -> None:
        """Sets some of the method's parameters (the learner's calibrated bounds,
        asyncfp8/correction/calibration.py); checked as at construction."""
        merged = self.params | params
        self._method = _bind(self.name, merged)
        self.params = merged

    def __repr__(self) -> str:
        extra = f", reject={[n for n, _ in self.rejections]}" if self.rejections else ""
        return f"Correction({self.name!r}, {self.params}{extra})"

    def __call__(
        self,
        learner_logp: torch.Tensor,
        rollout_logp: torch.Tensor,
        mask: torch.Tensor,
        versions: torch.Tensor | None = None,
        current_version: int | None = None,
    ) -> CorrectionResult:
        batch = make_batch(learner_logp, rollout_logp, mask, versions, current_version)
        metrics = mismatch_metrics(batch) | staleness_metrics(batch)

        fresh = batch.mask
        if self.max_staleness is not None:
            too_old = (batch.staleness > self.max_staleness).any(-1, keepdim=True)
            fresh = batch.mask & ~too_old
            has_tokens = batch.mask.any(-1)
            metrics["staleness/frac_dropped"] = (has_tokens & too_old[:, 0]).sum().item() / max(
                has_tokens.sum().item(), 1
            )

        result = self._method(batch)
        keep = result.keep & fresh
        for _, rejection in self.rejections:
            keep = keep & rejection(batch).keep
        weights = (
            torch.broadcast_to(result.weights, batch.mask.shape).masked_fill(~keep, 0.0).detach()
        )
        metrics |= weight_metrics(batch, result, weights, keep) | result.metrics
        return CorrectionResult(weights=weights, mask=keep, metrics=metrics)


def make_batch(
    learner_logp, rollout_logp, mask, versions=None, current_version=None
) -> CorrectionBatch:
    """Validates the inputs and computes the clamped log-ratio."""
    tensors = {"learner_logp": learner_logp, "rollout_logp": rollout_logp, "mask": mask}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
    shapes = {key: tuple(value.shape) for key, value in tensors.items()}
    if len(set(shapes.values())) != 1 or learner_logp.dim() != 2:
        raise ValueError(f"learner_logp, rollout_logp and mask must all be [B, T]; got {shapes}")
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask must be bool or hold only 0 and 1")
        mask = mask.bool()
    for key in ("learner_logp", "rollout_logp"):
        value = tensors[key]
        if not value.is_floating_point():
            raise ValueError(f"{key} must be a float tensor, got {value.dtype}")
        bad = torch.isnan(value) & mask
        if bad.any():
            raise ValueError(
                f"{key} is NaN at {bad.sum().item()} unmasked positions "
                f"(first at {bad.nonzero()[0].tolist()})"
            )
        if ((value > 1e-4) & mask).any():
            raise ValueError(
                f"{key} has positive log-probabilities at unmasked positions: are these logits?"
            )
    with torch.no_grad():
        delta = learner_logp.detach().float() - rollout_logp.detach().float()
        # -inf - -inf is NaN: both sides gave the token zero probability; no evidence of mismatch.
        delta = torch.nan_to_num(delta, nan=0.0).clamp(-RAW_LOG_RATIO_LIMIT, RAW_LOG_RATIO_LIMIT)
        raw_log_ratio = delta.masked_fill(~mask, 0.0)
        log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if versions is not None:
        if tuple(versions.shape) != shapes["mask"]:
            raise ValueError(
                f"versions must be [B, T] like the logprobs {shapes['mask']}, "
                f"got {tuple(versions.shape)}"
            )
        if current_version is None:
            raise ValueError("versions were given without current_version")
        versions = versions.long()
    return CorrectionBatch(
        learner_logp, rollout_logp, mask, log_ratio, versions, current_version, raw_log_ratio
    )


def get_correction(name: str, **params: Any) -> Correction:
    """`get_correction("token_tis", threshold=2.0)`; `reject=[...]` adds rejection
    filters (`[{"name": "seq_mean_k3", "upper": 0.01}]`), `max_staleness=N` masks
    sequences with a token more than N versions old."""
    reject = params.pop("reject", ()) or ()
    max_staleness = params.pop("max_staleness", None)
    return Correction(name, params, reject=reject, max_staleness=max_staleness)


def build_correction(cfg: Mapping[str, Any]) -> Correction:
    """A correction from its `correction=` config entry (see asyncfp8/conf/correction/)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        params = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    else:
        params = dict(cfg)
    if "name" not in params:
        raise ValueError(f"correction config needs a 'name'; got keys {sorted(params)}")
    name = params.pop("name")
    max_staleness = params.pop("max_staleness", None)
    # The learner's keys, not the method's: how the loss uses π_prox (train/losses.py), which
    # weights it is (train/versions.py), where it is scored (train/proximal_thread.py), and
    # how an MoE's forward routes (train/moe_routing.py).
    for key in ("mode", "proximal", "proximal_thread", "routing_replay"):
        params.pop(key, None)
    # bounds calibration and the starved-step rule: the learner's (correction/calibration.py);
    # a key left out of a hand-made entry takes the schema's default
    base = CorrectionConfig()
    rejection = [params.pop(key, getattr(base, key)) for key in REJECTION_KEYS]
    check_rejection_settings(name, *rejection)
    # null: the method's own default (or, under target_rejected, a calibrated bound)
    params = {key: value for key, value in params.items() if value is not None}
    return get_correction(name, max_staleness=max_staleness, **params)


register_correction("none", none)
register_correction("token_tis", token_tis)
register_correction("token_mis", token_mis)
register_correction("icepop", token_mis)
register_correction("seq_tis", seq_tis)
register_correction("seq_mis", seq_mis)
register_correction("geo_rs", geo_rs)
register_correction("stale_tis", stale_tis)
for _estimator in KL_ESTIMATORS:
    register_correction(f"token_{_estimator}", kl_rejection(_estimator, "token"))
    for _level in ("sum", "mean", "max"):
        register_correction(f"seq_{_level}_{_estimator}", kl_rejection(_estimator, _level))
