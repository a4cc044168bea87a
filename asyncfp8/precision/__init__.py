"""Precision policies: how the learner's weights become what a rollout engine runs.

from asyncfp8.precision import PrecisionPolicy, get_policy, register_policy
policy = get_policy("fp8")          # "bf16", "fp16", "fp8", "fp8_kv", "fp8+fp8_kv", "int8"
policy.quantizes(name, tensor)      # the per-tensor decision everything asks
policy.engine_config()              # how the engine must be started
policy.quantize_weights(named)      # streaming (name, tensor) -> (name, tensor)
policy.calibrate(model, batch)      # extra tensors for this version (KV scales)
version_tensors(model, policy, batch)  # both, for one version of a model, with roles
check_received(number, tensors, manifest, expected)  # an engine's one check of a version
"""

from . import bf16, fp8, fp8_kv, fp16, int8, mixed  # noqa: F401  (registers the built-in policies)
from .manifest import Role, TensorRole, TensorSpec, check_received
from .policy import (
    ComposedPolicy,
    PrecisionPolicy,
    build_policy,
    get_policy,
    is_quantizable,
    register_policy,
    registered_policies,
)
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
