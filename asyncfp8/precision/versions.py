"""What one version sends, built in one place (learner, demo, benchmarks and tests all
call it): the policy's engine-side tensors streamed from a model's master parameters,
and the extra tensors (KV scales) its calibration adds."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .policy import PrecisionPolicy


@dataclass
class VersionTensors:
    """`weights` streams one learner tensor at a time (never the whole quantized model);
    `extra` is computed up front, from the same weights."""

    weights: Iterator[tuple[str, torch.Tensor]]
    extra: dict[str, torch.Tensor]


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _weights(
    policy: PrecisionPolicy, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, master in named:
        master = master.detach()
        for out_name, out in policy.quantize_weights([(name, master)]):
            # A policy may pass a master tensor through unchanged (an FP32 LM head): the
            # version must not alias weights the optimizer will update in place.
            yield out_name, out.clone() if _shares_storage(out, master) else out


def version_tensors(
    model: torch.nn.Module,
    policy: PrecisionPolicy,
    calibration_batch: Mapping[str, torch.Tensor] | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> VersionTensors:
    """The tensors of a version of `model` (its parameters, in their master dtype, are
    what the policy receives and casts itself). `weights` replaces
    `model.named_parameters()` as the master tensors sent: a sharded model's parameters,
    gathered whole (calibration still runs `model`). Extra tensors come back on the CPU."""
    extra: dict[str, torch.Tensor] = {}
    if policy.needs_calibration:
        if calibration_batch is None:
            raise ValueError(
                f"precision {policy.name!r} calibrates every version (KV scales): pass a "
                "calibration batch (input_ids, attention_mask)"
            )
        with torch.no_grad():
            extra = {
                name: tensor.cpu()
                for name, tensor in policy.calibrate(model, calibration_batch).items()
            }
    named = model.named_parameters() if weights is None else weights
    return VersionTensors(_weights(policy, named), extra)
