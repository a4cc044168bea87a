"""Dynamic loss scaling, for a learner computing in FP16 (`run.compute_dtype=float16`,
`optim.loss_scale.*`): the loss is scaled before the backward so small gradients do not
flush to zero; an overflow skips the update and halves the scale. Not `torch.amp.GradScaler`:
the step folds the unscale into its one gradient division, every rank must agree, and the
stopping message names the first non-finite gradient (docs/precision.md)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("asyncfp8.learner")


class LossScaleOverflow(FloatingPointError):
    """The loss scale kept overflowing: `optim.loss_scale.max_skipped` updates in a row."""


@dataclass(frozen=True)
class LossScaleSettings:
    init: float = 65536.0
    growth_interval: int = 100
    max_skipped: int = 8

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> LossScaleSettings:
        """From `optim.loss_scale` (None: the defaults); ValueError naming the key for a
        value out of range."""
        values = dict(node or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"optim.loss_scale has no {', '.join(unknown)} (it has: init, growth_interval, "
                "max_skipped)"
            )
        settings = cls(**values)
        init = settings.init
        if isinstance(init, bool) or not isinstance(init, int | float) or not 0 < init < 2**64:
            raise ValueError(f"optim.loss_scale.init must be a number > 0, got {init!r}")
        for key in ("growth_interval", "max_skipped"):
            value = getattr(settings, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"optim.loss_scale.{key} must be an integer >= 1, got {value!r}")
        return settings


def first_nonfinite_gradient(model: torch.nn.Module) -> tuple[str | None, int]:
    """(the first parameter, in the model's order, with a non-finite gradient on any rank,
    or None; how many parameters have one). Collective: every rank calls it."""
    # Here, not at the top: the launcher checks LossScaleSettings without paying 0.7 s
    # for importing torch.distributed's checkpoint, FSDP and DTensor modules.
    from asyncfp8.run import distributed

    names = [name for name, _ in model.named_parameters()]
    first, count = len(names), 0
    for index, (_, param) in enumerate(model.named_parameters()):
        grad = param.grad
        if grad is None:
            continue
        if not bool(torch.isfinite(distributed.local_shard(grad)).all()):
            first, count = min(first, index), count + 1
    # Sharded: a parameter's gradient is split over ranks; the lowest index any rank saw.
    reduced = distributed.max_over_ranks({"first": -first})
    first = int(-reduced["first"])
    count = int(distributed.sum_over_ranks({"count": count})["count"])
    return (names[first] if first < len(names) else None), count


class LossScaler:
    """The scale the loss is multiplied by before each backward pass, and what decides
    whether an update steps (see the module's docstring)."""

    def __init__(self, settings: LossScaleSettings):
        self.settings = settings
        self.scale = float(settings.init)
        self.good_in_row = 0  # updates since the last overflow or growth
        self.skipped_in_row = 0
        self.skipped_total = 0

    def stepped(self) -> None:
        """An update whose gradients were all finite, applied or skipped for another reason
        (a starved update): it ends the overflow streak and counts toward growth."""
        self.skipped_in_row = 0
        self.good_in_row += 1
        if self.good_in_row >= self.settings.growth_interval:
            self.scale *= 2.0
            self.good_in_row = 0

    def overflowed(self, model: torch.nn.Module, step: int) -> None:
        """An update whose gradients overflowed: it is skipped and the scale halved; the
        `max_skipped`-th in a row raises LossScaleOverflow naming the setting and the first
        parameter whose gradient was not finite. Collective."""
        layer, count = first_nonfinite_gradient(model)
        self.skipped_total += 1
        self.skipped_in_row += 1
        self.good_in_row = 0
        where = f"{layer} first (of {count} parameters)" if layer else "no parameter (the loss)"
        if self.skipped_in_row >= self.settings.max_skipped:
            raise LossScaleOverflow(
                f"step {step}: FP16 gradients overflowed in {self.skipped_in_row} updates in a "
                f"row (optim.loss_scale.max_skipped={self.settings.max_skipped}), the last at "
                f"loss scale {self.scale:g}; non-finite gradients in {where}. A scale this low "
                "that still overflows points at activations past FP16's range (65504) in the "
                "forward pass, not at the scale: train with run.compute_dtype=bfloat16 or "
                "float32 (or raise optim.loss_scale.max_skipped to let the scale fall further)"
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(
                "step %d: FP16 gradients overflowed (non-finite in %s) at loss scale %g: update "
                "skipped, scale now %g (%d in a row; optim.loss_scale.max_skipped=%d)",
                step,
                where,
                self.scale,
                self.scale / 2.0,
                self.skipped_in_row,
                self.settings.max_skipped,
            )
        self.scale /= 2.0

    def metrics(self, skipped: int) -> dict[str, float]:
        """The step's metrics: the scale after it, its skipped updates, the run's."""
        return {
            "loss_scale/scale": self.scale,
            "loss_scale/skipped": skipped,
            "loss_scale/skipped_total": self.skipped_total,
        }

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "good_in_row": self.good_in_row,
            "skipped_in_row": self.skipped_in_row,
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_in_row = int(state["good_in_row"])
        self.skipped_in_row = int(state["skipped_in_row"])
        self.skipped_total = int(state["skipped_total"])
