"""The `correction=` config as schemas in Hydra's ConfigStore: one base for the keys every
correction has (`name`, `reject`, `mode`, `proximal`, `max_staleness`, `target_rejected`,
`min_kept`, `starved`) and, for every registered
method, a dataclass with its own parameters, typed from its signature. Each YAML under
conf/correction/ extends its method's schema, so a mistyped key
(`correction.uper=5`) or a wrong type (`correction.upper=five`) fails when the config is
composed, naming the key; value checks (lower <= upper, ...) stay with the methods."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from typing import Any

from .calibration import Starved


class Mode(enum.StrEnum):
    decoupled = "decoupled"  # the learner recomputes π_prox; three policies
    bypass = "bypass"  # π_prox := π_rollout


class Proximal(enum.StrEnum):
    auto = "auto"  # version where the learner can keep the versions, else current
    current = "current"  # decoupled π_prox: the learner's weights now
    version = "version"  # its weights of the version that sampled each token


@dataclasses.dataclass
class CorrectionConfig:
    """Keys every correction has."""

    name: str = "none"
    reject: list[Any] = dataclasses.field(default_factory=list)  # more rejection filters
    mode: Mode = Mode.decoupled
    proximal: Proximal = Proximal.auto  # asyncfp8/train/versions.py: choose_proximal
    max_staleness: int | None = None  # mask sequences with a token older than this
    # calibrate the unset lower/upper bounds of token_mis, seq_mis, geo_rs for this share
    # rejected on the first step (asyncfp8/correction/calibration.py); null: off
    target_rejected: float | None = None
    min_kept: float = 0.5  # an update keeping fewer of its tokens than this is starved
    starved: Starved = Starved.scale  # a starved update: lr scaled to what was kept, or skipped


def method_schema(name: str, method: Any) -> type:
    """A dataclass for `correction=<name>`: the base keys and the method's parameters."""
    hints = typing.get_type_hints(method)
    fields = []
    for parameter in list(inspect.signature(method).parameters.values())[1:]:
        hint = hints.get(parameter.name, Any)
        # null: the method's own default (a bound under target_rejected: calibrated)
        typed = hint | None if hint in (int, float, bool, str) else Any
        fields.append((parameter.name, typed, parameter.default))
    return dataclasses.make_dataclass(name, fields, bases=(CorrectionConfig,))


def register_schemas() -> None:
    """Stores `schema/correction/<name>` for every registered correction."""
    from hydra.core.config_store import ConfigStore

    from .registry import _METHODS

    store = ConfigStore.instance()
    for name, method in _METHODS.items():
        store.store(group="schema/correction", name=name, node=method_schema(name, method))
