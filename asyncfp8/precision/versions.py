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


def version_weights(
    policy: PrecisionPolicy, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's engine-side tensors for `named` master tensors, one at a time."""
    for name, master in named:
        master = master.detach()
        for out_name, out in policy.quantize_weights([(name, master)]):
            # A policy may pass a master tensor through unchanged (an FP32 LM head): the
            # version must not alias weights the optimizer will update in place.
            yield out_name, out.clone() if _shares_storage(out, master) else out


def calibrate_version(
    model: torch.nn.Module,
    policy: PrecisionPolicy,
    calibration_batch: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The extra tensors (KV scales) of a version of `model`, on the CPU (where the
    codec reads them) whatever device the model is on: none for a policy that does not
    calibrate."""
    if not policy.needs_calibration:
        return {}
    if calibration_batch is None:
        raise ValueError(
            f"precision {policy.name!r} calibrates every version (KV scales): pass a "
            "calibration batch (input_ids, attention_mask)"
        )
    with torch.no_grad():
        return {
            name: tensor.cpu()
            for name, tensor in policy.calibrate(model, calibration_batch).items()
        }


def version_tensors(
    model: torch.nn.Module,
    policy: PrecisionPolicy,
    calibration_batch: Mapping[str, torch.Tensor] | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> VersionTensors:
    """The tensors of a version of `model` (its parameters, in their master dtype, are
    what the policy receives and casts itself). `weights` replaces
    `model.named_parameters()` as the master tensors sent: a sharded model's parameters,
    gathered whole (calibration still runs `model`). The learner, which publishes from a
    snapshot of its weights on a background thread, calls the two halves itself."""
    extra = calibrate_version(model, policy, calibration_batch)
    named = model.named_parameters() if weights is None else weights
    return VersionTensors(version_weights(policy, named), extra)
