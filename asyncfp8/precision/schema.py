"""The `precision=` config as a schema: the keys every policy entry has (`name`, `_target_`,
`learner_forward`, `quantize_from`, `engine_dtype`) are typed in Hydra's ConfigStore; a policy's own
parameters are checked against its constructor (names and annotated types), so a typo or a
wrong type fails at start. The node stays open: a user's class brings parameters of its own."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any


class LearnerForward(enum.StrEnum):
    master = "master"  # the learner's FP32 forward
    quantized = (
        "quantized"  # the engine's quantized forward, fake-quant with straight-through gradients
    )


class QuantizeFrom(enum.StrEnum):
    master = "master"  # the learner's FP32 master weights
    compute = "compute"  # the masters rounded to run.compute_dtype, what the learner's forward uses


class EngineDtype(enum.StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@dataclasses.dataclass
class PrecisionConfig:
    """Keys every `precision=` entry has (`precision=<name>` picks the policy; its own
    parameters, such as `precision.lm_head_fp32`, come beside them: docs/precision.md)."""

    name: str | None = dataclasses.field(
        default=None, metadata={"help": "the policy (set by precision=<name>)"}
    )
    _target_: str | None = dataclasses.field(
        default=None, metadata={"help": "a PrecisionPolicy class of your own"}
    )
    learner_forward: LearnerForward = dataclasses.field(
        default=LearnerForward.master,
        metadata={
            "help": "master: the learner's FP32 forward; quantized: the engine's quantized "
            "forward, fake-quant with straight-through gradients"
        },
    )
    quantize_from: QuantizeFrom = dataclasses.field(
        default=QuantizeFrom.master,
        metadata={
            "help": "master: quantize the FP32 masters; compute: the masters rounded to "
            "run.compute_dtype, what the learner's forward uses"
        },
    )
    engine_dtype: EngineDtype | None = dataclasses.field(
        default=None,
        metadata={
            "help": "what the engine computes in around its quantized GEMMs (null: the "
            "policy's own, bfloat16 but for fp16); float32 with learner_forward=quantized "
            "and an FP32 learner (run.compute_dtype) makes the two forwards one (torch engine)"
        },
    )


def schema_node():
    """The ConfigStore node `schema/precision` that every precision YAML extends."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(PrecisionConfig)
    OmegaConf.set_struct(node, False)  # open to a user policy's own parameters
    return node


def parameters(factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The keyword parameters a factory takes (for a class: its __init__'s)."""
    return {
        name: p
        for name, p in inspect.signature(factory).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


_CHECKED_TYPES = (int, float, bool, str)


def _checkable(hint: Any) -> Any:
    """`hint` if OmegaConf can check it (a scalar type, optionally Optional), else Any."""
    if hint in _CHECKED_TYPES:
        return hint
    args = typing.get_args(hint)
    if type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        if inner in _CHECKED_TYPES:
            return inner | None
    return Any


def _hints(factory: Callable[..., Any]) -> dict[str, Any]:
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation that does not evaluate: check names only
        return {}


def check_params(label: str, factory: Callable[..., Any], params: Mapping[str, Any]) -> None:
    """Refuses, naming the key, a parameter `factory` does not take or a value of the
    wrong type for its annotation."""
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    accepted = parameters(factory)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"precision {label!r} takes no parameter(s) {unknown} "
            f"(it takes: {', '.join(accepted) or 'none'})"
        )
    hints = {name: _checkable(hint) for name, hint in _hints(factory).items()}
    typed = [name for name in params if hints.get(name, Any) is not Any]
    if not typed:
        return
    schema = dataclasses.make_dataclass(
        "policy_parameters",
        [(name, hints[name], dataclasses.field(default=MISSING)) for name in typed],
    )
    try:
        OmegaConf.merge(OmegaConf.structured(schema), {name: params[name] for name in typed})
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "?"
        expected = str(hints.get(key, "another type")).replace("<class '", "").replace("'>", "")
        raise ValueError(
            f"precision.{key}={params.get(key)!r}: precision {label!r} expects {expected}"
        ) from None
