"""What the vLLM and SGLang adapters share: the checkpoint a quantized policy starts them
from (exported once, cached beside the model), and what a version must hold to fit that
checkpoint (`version_specs`, for `asyncfp8.precision.check_received`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.export import export_checkpoint, read_tensors, unquantized_layers
from asyncfp8.precision.manifest import TensorSpec, kv_scale_specs

from .base import EngineUnsupported


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


def version_specs(model_dir: Path, policy: PrecisionPolicy) -> dict[str, TensorSpec]:
    """What a version may hold for an engine started from the checkpoint in `model_dir`:
    every tensor of the checkpoint (a weight or a weight's scale: the checkpoint does not
    say which), and the KV scales the policy calibrates, with their roles."""
    kv = kv_scale_specs(policy.extra_roles() if policy.needs_calibration else {})
    checkpoint = {
        name: TensorSpec(tuple(tensor.shape), tensor.dtype)
        for name, tensor in read_tensors(model_dir)
    }
    return checkpoint | kv
