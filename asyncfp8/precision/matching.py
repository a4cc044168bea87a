"""`precision.engine_dtype=auto` and `learner_forward=auto`, resolved per run: 8-bit weights
(fp8, int8, either with fp8_kv) on the torch engine on the CPU compute in FP32 around their
GEMMs and the learner trains through the quantization, so the two forwards are one
(docs/precision.md, "The engine's compute dtype"). Elsewhere: the policy's own dtype and the
master forward (vLLM/SGLang compute in BF16; on a GPU, FP32's cost is unmeasured)."""

from __future__ import annotations

from typing import Any

import torch

AUTO = "auto"
EIGHT_BIT_WEIGHTS = ("fp8", "int8")


def eight_bit_weights(precision: Any) -> bool:
    """A named policy whose weights are 8-bit (a user's `_target_` class says nothing)."""
    name = precision.get("name")
    if precision.get("_target_") or not name:
        return False
    return str(name).split("+")[0] in EIGHT_BIT_WEIGHTS


def matches_by_default(precision: Any, engine: Any) -> bool:
    """Whether auto makes this run's forwards one: 8-bit weights, the torch engine, the CPU."""
    if not eight_bit_weights(precision) or engine.get("name") != "torch":
        return False
    device = str(engine.get("device", AUTO))
    return device == "cpu" or (device == AUTO and not torch.cuda.is_available())


def resolve_auto(precision: Any, engine: Any) -> dict[str, str | None]:
    """The concrete values of the precision keys set to auto (none when none is), to be
    set in the config before anything builds from it. An explicit value is kept, and an
    auto beside it follows it: `learner_forward=master` keeps the engine's own dtype, and
    `engine_dtype=float32` with 8-bit weights trains through the quantization."""
    dtype, forward = str(precision.get("engine_dtype")), str(precision.get("learner_forward"))
    if AUTO not in (dtype, forward):
        return {}
    resolved: dict[str, str | None] = {}
    if dtype == AUTO:
        takes = forward in (AUTO, "quantized")
        resolved["engine_dtype"] = (
            "float32" if takes and matches_by_default(precision, engine) else None
        )
    if forward == AUTO:
        engine_dtype = resolved.get("engine_dtype", precision.get("engine_dtype"))
        matched = eight_bit_weights(precision) and str(engine_dtype) == "float32"
        resolved["learner_forward"] = "quantized" if matched else "master"
    return resolved
