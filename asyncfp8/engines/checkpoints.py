"""What the vLLM and SGLang adapters share: the checkpoint a quantized policy starts them
from (exported once, cached beside the model), and the check that a version fits that
checkpoint, made before any of it is applied."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.export import export_checkpoint, read_tensors, unquantized_layers
from asyncfp8.precision.fp8_kv import KV_SCALE_NAME

from .base import EngineUnsupported

TensorSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def refuse_unsupported(
    engine: str, policy: PrecisionPolicy, formats: tuple[str, ...], source: Path
) -> None:
    """EngineUnsupported, at start, for a policy that says `engine` cannot run it (on the
    model in `source`, which the policy is bound to here if it is not yet) or whose weight
    format (`engine_config()["quantization"]`) is not among the `formats` the adapter
    knows how to start and refit."""
    if policy.model_config is None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(source, local_files_only=True))
    reason = policy.supported_by(engine)
    quantization = policy.engine_config().get("quantization")
    if not reason and quantization is not None and quantization not in formats:
        reason = (
            f"its weight format {quantization!r} is not one this adapter starts and refits "
            f"({', '.join(formats)}); engine=torch runs any policy with a linear_module"
        )
    if reason:
        raise EngineUnsupported(f"engine {engine} cannot run precision {policy.name!r}: {reason}")


def policy_checkpoint(policy: PrecisionPolicy, source: Path, export_dir: str | None) -> Path:
    """`source` itself when the policy has no checkpoint format, else `source` exported in
    the policy's format (quantized weights, the layers it leaves unquantized listed as
    ignored, KV-scale parameters) to `export_dir` or a directory beside it named after
    the source, the policy and the format."""
    if policy.model_config is None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(source, local_files_only=True))
    config = policy.checkpoint_config(unquantized_layers(policy, source))
    if not config:
        return source
    key = hashlib.sha256(f"{source.resolve()}:{policy.spec}:{config}".encode()).hexdigest()
    out = (
        Path(export_dir)
        if export_dir
        else source.parent / f".{source.name}-{policy.name}-{key[:12]}"
    )
    if not (out / "config.json").is_file():
        export_checkpoint(policy, source, out, require_calibration=False)
    return out


def tensor_specs(model_dir: Path) -> TensorSpecs:
    """Name → (shape, dtype) of every tensor of a checkpoint."""
    return {name: (tuple(t.shape), t.dtype) for name, t in read_tensors(model_dir)}


def check_version(
    version: int, named_tensors: Mapping[str, torch.Tensor], expected: TensorSpecs
) -> None:
    """Refuses a version with an unknown tensor, a wrong shape or dtype, or (unless it has
    no weights at all) a missing weight: versions are applied whole."""
    for name, tensor in named_tensors.items():
        spec = expected.get(name)
        if spec is None:
            raise ValueError(
                f"version {version}: unknown tensor {name!r} (is the worker's model the learner's?)"
            )
        if (tuple(tensor.shape), tensor.dtype) != spec:
            raise ValueError(
                f"version {version}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the engine expects "
                f"{spec[0]} {spec[1]}"
            )
    missing = [n for n in expected if n not in named_tensors and not KV_SCALE_NAME.match(n)]
    if named_tensors and missing:
        raise ValueError(
            f"version {version} lacks {len(missing)} of the engine's weights (first: "
            f"{missing[0]}); a version is applied whole"
        )
