"""The registry of precision policies and how one is built: by name (`get_policy`, parts
composed with "+"), from a `precision=` config entry (`build_policy`), or from a class of
the user's own (`precision._target_`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .policy import ComposedPolicy, PrecisionPolicy
from .schema import check_params, parameters

LEARNER_FORWARDS = ("master", "quantized")
QUANTIZE_FROMS = ("master", "compute")
ENGINE_DTYPES = ("bfloat16", "float16", "float32")

_POLICIES: dict[str, Callable[..., PrecisionPolicy]] = {}


def register_policy(name: str, factory: Callable[..., PrecisionPolicy] | None = None):
    """Register a PrecisionPolicy subclass (or any factory of one) under `name`;
    usable as a class decorator."""

    def add(fn):
        if "+" in name:
            raise ValueError(f"policy names cannot contain '+' (it composes policies): {name!r}")
        if name in _POLICIES and _POLICIES[name] is not fn:
            raise ValueError(f"a precision policy named {name!r} is already registered")
        _POLICIES[name] = fn
        return fn

    return add(factory) if factory is not None else add


def registered_policies() -> list[str]:
    return sorted(_POLICIES)


def plain(value: Any) -> Any:
    """Tuples as lists (in dicts too), so that a default (128, 128), a YAML [128, 128] and
    what msgpack gives back compare equal."""
    if isinstance(value, Mapping):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


def _spec(name: str, factory: Callable[..., Any], params: Mapping[str, Any]) -> str:
    """`name(key=value, ...)` over every parameter, given or default: two processes that
    built the same policy from differently written configs get the same spec."""
    effective = {
        key: plain(params.get(key, p.default))
        for key, p in parameters(factory).items()
        if key in params or p.default is not p.empty
    }
    shown = ", ".join(f"{key}={effective[key]!r}" for key in sorted(effective))
    return f"{name}({shown})" if shown else name


def _make(label: str, factory: Callable[..., Any], params: Mapping[str, Any]) -> PrecisionPolicy:
    check_params(label, factory, params)
    policy = factory(**params)
    if not isinstance(policy, PrecisionPolicy):
        raise ValueError(
            f"precision {label!r} made a {type(policy).__name__}, not a PrecisionPolicy"
        )
    return policy


def get_policy(name: str, **params: Any) -> PrecisionPolicy:
    """`get_policy("fp8")`, `get_policy("fp8+fp8_kv", margin=1.1)`. Parameters go to
    every part that accepts them; one no part accepts is an error."""
    parts_names = [part.strip() for part in name.split("+")]
    unknown = [n for n in parts_names if n not in _POLICIES]
    if unknown or not all(parts_names):
        raise ValueError(
            f"unknown precision policy {name!r}; registered: {', '.join(registered_policies())} "
            "(compose with '+', e.g. 'fp8+fp8_kv'; "
            "a class of your own: precision._target_=pkg.Class)"
        )
    parts, used = [], set()
    for part_name in parts_names:
        factory = _POLICIES[part_name]
        mine = {k: v for k, v in params.items() if k in parameters(factory)}
        used |= set(mine)
        part = _make(part_name, factory, mine)
        part.spec = _spec(part.name, factory, mine)
        parts.append(part)
    unused = sorted(set(params) - used)
    if unused:
        taken = sorted({key for n in parts_names for key in parameters(_POLICIES[n])})
        raise ValueError(
            f"precision {name!r} takes no parameter(s) {unused} "
            f"(it takes: {', '.join(taken) or 'none'})"
        )
    if len(parts) == 1:
        return parts[0]
    composed = ComposedPolicy(parts)
    composed.spec = "+".join(p.spec for p in parts)
    return composed


def import_target(target: str) -> Callable[..., Any]:
    """The object `pkg.module.Name` names; ValueError saying what failed."""
    module_name, _, attribute = target.rpartition(".")
    if not module_name:
        raise ValueError(
            f"precision._target_={target!r} must be a dotted path (package.module.ClassName)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"precision._target_={target!r}: cannot import {module_name!r} ({err}); is it on "
            "PYTHONPATH for the learner and every worker?"
        ) from None
    if not hasattr(module, attribute):
        raise ValueError(f"precision._target_={target!r}: {module_name} has no {attribute!r}")
    return getattr(module, attribute)


def policy_from_target(target: str, params: dict[str, Any]) -> PrecisionPolicy:
    """A user's policy class, with its parameters."""
    factory = import_target(target)
    if not (inspect.isclass(factory) and issubclass(factory, PrecisionPolicy)):
        raise ValueError(
            f"precision._target_={target!r} is {factory!r}, not a PrecisionPolicy subclass "
            "(from asyncfp8.precision import PrecisionPolicy)"
        )
    policy = _make(target, factory, params)
    policy.spec = _spec(f"{target}:{policy.name}", factory, params)
    return policy


def check_engine_dtype(policy: PrecisionPolicy) -> None:
    """A policy's two statements of what an engine computes in must agree: the built-in
    torch engine and the refit probe's reference use `engine_dtype`, vLLM and SGLang are
    started with `engine_config()["dtype"]`. A subclass that changed one and not the other
    would fail its first refit probe, or run another precision than it says."""
    configured = policy.engine_config().get("dtype")
    if configured is None:
        return
    # vLLM's aliases ("float", "half") name torch dtypes too
    if getattr(torch, str(configured), None) != policy.engine_dtype:
        raise ValueError(
            f"precision {policy.spec or policy.name!r}: engine_config() says dtype "
            f"{configured!r} but engine_dtype is {policy.engine_dtype}; set both to the same "
            "(the torch engine computes in engine_dtype, vLLM / SGLang start with "
            "engine_config()['dtype'])"
        )


def build_policy(cfg: Mapping[str, Any], model_dir: Any = None) -> PrecisionPolicy:
    """A policy from its `precision=` config entry: `name` (registered, or composed with
    '+') or `_target_` (a PrecisionPolicy subclass of your own, imported here), plus
    parameters, `learner_forward`, `quantize_from`, `engine_dtype`, and bound to the model
    in `model_dir` when given. With `_target_`, `name` is not used (the class says its own)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        params = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    else:
        params = dict(cfg)
    target = params.pop("_target_", None)
    name = params.pop("name", None)
    learner_forward = params.pop("learner_forward", "master")
    if learner_forward not in LEARNER_FORWARDS:
        raise ValueError(
            f"precision.learner_forward must be one of {', '.join(LEARNER_FORWARDS)}, "
            f"got {learner_forward!r}"
        )
    quantize_from = params.pop("quantize_from", "master")
    engine_dtype = params.pop("engine_dtype", None)
    if engine_dtype not in (None, *ENGINE_DTYPES):
        raise ValueError(
            f"precision.engine_dtype must be one of {', '.join(ENGINE_DTYPES)} or null, "
            f"got {engine_dtype!r}"
        )
    if quantize_from not in QUANTIZE_FROMS:
        raise ValueError(
            f"precision.quantize_from must be one of {', '.join(QUANTIZE_FROMS)}, "
            f"got {quantize_from!r}"
        )
    if target:
        policy = policy_from_target(target, params)
    elif name:
        policy = get_policy(name, **params)
    else:
        raise ValueError(
            f"precision config needs a 'name' or a '_target_'; got keys {sorted(params)}"
        )
    policy.learner_forward = learner_forward
    policy.quantize_from = quantize_from
    if engine_dtype is not None:
        policy.set_engine_dtype(getattr(torch, engine_dtype))
    if model_dir is not None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    check_engine_dtype(policy)  # after the bind: an engine_config may read the model
    return policy
