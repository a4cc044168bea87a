"""Precision policies: how the learner's weights become what a rollout engine runs.

`get_policy("fp8")` ("bf16", "fp16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8", "mixed"), then
`version_tensors(model, policy, batch)` for each version and `check_received` in an engine:
the lifecycle and the per-tensor decision everything asks are in docs/precision.md."""

from . import bf16, fp8, fp8_kv, fp16, int8, mixed  # noqa: F401  (registers the built-in policies)
from .manifest import Role, TensorRole, TensorSpec, check_received
from .policy import ComposedPolicy, PrecisionPolicy, is_quantizable
from .registry import build_policy, get_policy, register_policy, registered_policies
from .version_content import (
    VersionTensors,
    calibrate_version,
    extra_roles,
    version_tensors,
    version_weights,
)

__all__ = [
    "ComposedPolicy",
    "PrecisionPolicy",
    "Role",
    "TensorRole",
    "TensorSpec",
    "VersionTensors",
    "build_policy",
    "calibrate_version",
    "check_received",
    "extra_roles",
    "get_policy",
    "is_quantizable",
    "register_policy",
    "registered_policies",
    "version_tensors",
    "version_weights",
]
