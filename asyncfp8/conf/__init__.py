"""Hydra config groups (a package so that Hydra can find them as `pkg://asyncfp8.conf`).

Importing it (Hydra does, before composing) stores the schemas the YAML files extend:
`schema/precision` (asyncfp8.precision.schema) and `schema/correction/<name>`
(asyncfp8.correction.schema)."""

from hydra.core.config_store import ConfigStore

from asyncfp8.correction.schema import register_schemas as _register_correction_schemas
from asyncfp8.precision.schema import schema_node as _precision_schema

ConfigStore.instance().store(group="schema", name="precision", node=_precision_schema())
_register_correction_schemas()
