"""The `correction=` config as schemas in Hydra's ConfigStore: one base for the keys every
correction has and, per registered method, a dataclass of its parameters typed from its
signature. Each YAML under conf/correction/ extends its method's schema, so a mistyped key
or a wrong type fails when the config is composed; value checks stay with the methods."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Mapping
from typing import Any

from .calibration import Starved


class Mode(enum.StrEnum):
    decoupled = "decoupled"  # the learner recomputes π_prox; three policies
    bypass = "bypass"  # π_prox := π_rollout


class Proximal(enum.StrEnum):
    auto = "auto"  # version where the learner can keep the versions, else current
    current = "current"  # decoupled π_prox: the learner's weights now
    version = "version"  # its weights of the version that sampled each token


# The learner's keys of a correction: its bounds calibrated, and the starved-update rule.
REJECTION_KEYS = ("target_rejected", "min_kept", "starved")


def help_field(default: Any, help: str) -> Any:
    """A field with its default and its help (the configuration reference shows both)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class CorrectionConfig:
    """Keys every correction has (`correction=<name>` picks the method; its own parameters,
    such as `correction.threshold` or `correction.upper`, come beside them)."""

    name: str = help_field("none", "the method (set by correction=<name>)")
    reject: list[Any] = dataclasses.field(
        default_factory=list, metadata={"help": "more rejection filters, each a method's entry"}
    )
    mode: Mode = help_field(
        Mode.decoupled,
        "decoupled: the learner recomputes π_prox (three policies); bypass: π_prox is the "
        "rollout's",
    )
    proximal: Proximal = help_field(
        Proximal.auto,
        "π_prox with decoupled: current (the learner's weights now), version (its weights of "
        "the version that sampled each token), auto (version where it can keep the versions)",
    )
    proximal_thread: bool | None = help_field(
        None,
        "with version: score stale tokens' π_prox on a thread of its own as their groups "
        "arrive, off the step's path; null: on a CPU learner (measured to pay there)",
    )
    routing_replay: bool = help_field(
        False,
        "MoE: the learner's forwards route each token to the experts the engine did, gate "
        "weights from its own router (R3); needs the torch engine's routes",
    )
    max_staleness: int | None = help_field(
        None, "mask sequences with a token older than this many versions; null: off"
    )
    target_rejected: float | None = help_field(
        None,
        "set the unset bounds of token_mis, seq_mis or geo_rs on the first step so that this "
        "share is rejected; null: off",
    )
    min_kept: float = help_field(0.5, "an update keeping fewer of its tokens than this is starved")
    starved: Starved = help_field(
        Starved.scale, "a starved update: scale (lr times the share kept) | skip"
    )


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


def register_schemas(methods: Mapping[str, Any]) -> None:
    """Stores `schema/correction/<name>` for every registered correction method."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, method in methods.items():
        store.store(group="schema/correction", name=name, node=method_schema(name, method))
