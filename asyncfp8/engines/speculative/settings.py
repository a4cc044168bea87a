"""`engine.speculative`: the torch engine's speculative decoding settings, checked at
start (the launcher, the learner and every worker check them before loading a model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("none", "fixed", "adaptive")


@dataclass(frozen=True)
class SpeculativeSettings:
    #: none: no drafter; fixed: draft `draft_tokens` every step; adaptive: TLT's control
    #: (on when the active batch is at or below `threshold` for `patience` steps, the
    #: draft length per batch-size bucket chosen among `ks` by a bandit on tokens/s)
    mode: str = "none"
    draft_tokens: int = 4
    threshold: int = 32
    patience: int = 10
    ks: tuple[int, ...] = (0, 1, 2, 3, 4)
    #: drafter optimizer steps after each generate call (online training; 0: frozen)
    train_steps: int = 20
    #: the most those steps may take, as a fraction of the generate call's own time (at
    #: least one step is made); None: all `train_steps`, however long they take
    train_time_fraction: float | None = 0.25
    lr: float = 1e-3
    batch_size: int = 16
    #: a drafter checkpoint to start from (`TorchEngine.drafter_state()` as saved by a
    #: worker); None: a freshly initialized drafter
    init: str | None = None
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @classmethod
    def from_config(
        cls, node: Mapping[str, Any] | None, engine: str, slots: int | None
    ) -> SpeculativeSettings:
        """The settings of an `engine.speculative` node (None: off); ValueError naming the
        setting for anything the engine cannot do."""
        if node is None:
            return cls()
        values = dict(node)
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"engine.speculative has unknown settings {unknown}")
        mode = values.get("mode", "none")
        if mode in (None, False):
            mode = "none"
        if mode not in MODES:
            raise ValueError(f"engine.speculative.mode must be one of {MODES}, got {mode!r}")
        if mode == "none":
            return cls()
        if engine != "torch":
            raise ValueError(
                f"engine.speculative.mode={mode}: engine {engine} cannot speculate with an "
                "online drafter; engine=torch with engine.slots=N can (or mode=none)"
            )
        if slots is None:
            raise ValueError(
                f"engine.speculative.mode={mode} runs in the torch engine's slot loop: set "
                "engine.slots=N, e.g. engine.slots=8"
            )
        settings = cls(**{**values, "mode": mode, "ks": tuple(values.get("ks", cls.ks))})
        for name in ("draft_tokens", "patience", "batch_size"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine.speculative.{name} must be an int >= 1, got {value!r}")
        threshold = settings.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(
                f"engine.speculative.threshold must be a batch size >= 1, got {threshold!r} "
                "(speculation would never switch on)"
            )
        if not settings.ks or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in settings.ks
        ):
            raise ValueError(
                f"engine.speculative.ks must be draft lengths >= 0, got {list(settings.ks)}"
            )
        if len(set(settings.ks)) != len(settings.ks) or max(settings.ks) < 1:
            raise ValueError(
                "engine.speculative.ks must be distinct with at least one k >= 1, "
                f"got {list(settings.ks)}"
            )
        if (
            isinstance(settings.train_steps, bool)
            or not isinstance(settings.train_steps, int)
            or settings.train_steps < 0
        ):
            raise ValueError(
                f"engine.speculative.train_steps must be an int >= 0, got {settings.train_steps!r}"
            )
        fraction = settings.train_time_fraction
        if fraction is not None and (
            isinstance(fraction, bool) or not isinstance(fraction, int | float) or not fraction > 0
        ):
            raise ValueError(
                "engine.speculative.train_time_fraction must be a number > 0 (a fraction of "
                f"each generate call's time) or null, got {fraction!r}"
            )
        if not settings.lr > 0:
            raise ValueError(f"engine.speculative.lr must be > 0, got {settings.lr!r}")
        if settings.init is not None and not Path(settings.init).is_file():
            raise ValueError(f"engine.speculative.init: no drafter checkpoint at {settings.init}")
        return settings

    @property
    def max_k(self) -> int:
        return self.draft_tokens if self.mode == "fixed" else max(self.ks)


def check_drafter_checkpoint(path: str, model_config) -> dict:
    """ValueError unless `path` holds a drafter trained for a model with this config
    (read without building anything: the check runs before the model loads); returns
    the state read, for a caller that goes on to load it."""
    import torch

    from asyncfp8.engines.speculative.drafter import check_checkpoint, target_signature

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: say which
        raise ValueError(f"engine.speculative.init: cannot read {path}: {err}") from None
    drafter = state.get("trainer", {}).get("drafter") if isinstance(state, dict) else None
    if not isinstance(drafter, Mapping):
        raise ValueError(f"engine.speculative.init: {path} is not an asyncfp8 drafter checkpoint")
    try:
        check_checkpoint(drafter.get("_extra_state"), target_signature(model_config))
    except ValueError as err:
        raise ValueError(f"engine.speculative.init={path}: {err}") from None
    return state
