"""Hydra config groups (a package so that Hydra can find them as `pkg://asyncfp8.conf`).

Importing it (Hydra does, before composing) stores the schemas the YAML files extend:
`schema/precision`, `schema/reward`, `schema/correction/<name>`, `schema/run`, `schema/optim`,
`schema/sync`, `schema/eval` and `schema/engine/<name>`."""

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from asyncfp8.correction.registry import registered_methods
from asyncfp8.correction.schema import register_schemas as _register_correction_schemas
from asyncfp8.precision.schema import schema_node as _precision_schema

from .schemas import register_schemas as _register_group_schemas


def _reward_schema():
    """`task.reward`: a `_target_` function plus its keyword arguments, any keys (so that
    `task.reward.marker=...` needs no `+`); the function's signature is checked when the
    task is built (asyncfp8.tasks.build_reward)."""
    node = OmegaConf.create({"_target_": "???"})
    OmegaConf.set_struct(node, False)
    return node


ConfigStore.instance().store(group="schema", name="precision", node=_precision_schema())
ConfigStore.instance().store(group="schema", name="reward", node=_reward_schema())
_register_correction_schemas(registered_methods())
_register_group_schemas()
