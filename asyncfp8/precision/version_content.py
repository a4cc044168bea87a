"""What one version sends, built in one place (learner, demo, benchmarks and tests all
call it): the policy's engine-side tensors streamed from a model's master parameters,
the extra tensors (KV scales) its calibration adds, and the role of each (its manifest,
`asyncfp8.precision.manifest`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .manifest import EXTRA, TensorRole, decoder_layers
from .policy import PrecisionPolicy


@dataclass
class VersionTensors:
    """`weights` streams one learner tensor at a time (never the whole quantized model);
    `extra` is computed up front, from the same weights. `roles` holds the extra
    tensors' roles from the start and each weight's as `weights` yields it."""

    weights: Iterator[tuple[str, torch.Tensor]]
    extra: dict[str, torch.Tensor]
    roles: dict[str, TensorRole] = field(default_factory=dict)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def version_weights(
    policy: PrecisionPolicy,
    named: Iterable[tuple[str, torch.Tensor]],
    roles: dict[str, TensorRole] | None = None,
    layers: Mapping[str, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's engine-side tensors for `named` master tensors, one at a time. Each
    one's role (the policy's `output_role`, the layer of its master tensor in `layers`,
    `manifest.decoder_layers`) is written into `roles`, when given, before it is yielded."""
    for name, master in named:
        master = master.detach()
        layer = None if layers is None else layers.get(name)
        for source, part in policy.source_tensors([(name, master)]):
            for out_name, out in policy.quantize_weights([(source, part)]):
                if roles is not None:
                    roles[out_name] = TensorRole(policy.output_role(source, out_name), layer)
                # A policy may pass a master tensor through unchanged (an FP32 LM head):
                # the version must not alias weights the optimizer will update in place.
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


def extra_roles(
    policy: PrecisionPolicy, extra: Mapping[str, torch.Tensor]
) -> dict[str, TensorRole]:
    """The roles of a version's extra tensors, as the policy describes them."""
    described = policy.extra_roles() if extra else {}
    return {name: described.get(name, EXTRA) for name in extra}


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
    if policy.model_config is None:
        policy.bind_model(model.config)
    extra = calibrate_version(model, policy, calibration_batch)
    named = model.named_parameters() if weights is None else weights
    roles = extra_roles(policy, extra)
    stream = version_weights(policy, named, roles, decoder_layers(model))
    return VersionTensors(stream, extra, roles)
