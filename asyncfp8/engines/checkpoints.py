"""What the vLLM and SGLang adapters share: the checkpoint a quantized policy starts them
from (exported once, cached beside the model), and what a version must hold to fit that
checkpoint (`version_specs`, for `asyncfp8.precision.check_received`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.export import export_checkpoint, read_tensors, unquantized_layers
from asyncfp8.precision.manifest import TensorSpec, kv_scale_specs
from asyncfp8.precision.policy import dtype_name

from .base import EngineUnsupported


def refuse_unsupported(
    engine: str,
    policy: PrecisionPolicy,
    supports: Callable[[PrecisionPolicy], str | None],
    source: Path,
) -> None:
    """EngineUnsupported, at start, for a policy the adapter's `supports` refuses (on the
    model in `source`, which the policy is bound to here if it is not yet)."""
    if policy.model_config is None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(source, local_files_only=True))
    reason = supports(policy)
    if reason:
        raise EngineUnsupported(f"engine {engine} cannot run precision {policy.name!r}: {reason}")


def checkpoint_refusal(policy: PrecisionPolicy, formats: tuple[str, ...]) -> str | None:
    """Why an engine started from a checkpoint (vLLM, SGLang) cannot run `policy`, or None:
    a weight format (`engine_config()["quantization"]`) not among the `formats` the adapter
    starts and refits, an FP32 LM head (neither has the option), 8-bit weights or an FP8
    KV cache around FP32 activations, and for blockwise FP8
    blocks other than 128x128 or a model whose fused projections are not whole blocks."""
    config = policy.engine_config()
    quantization = config.get("quantization")
    engine_dtype = config.get("dtype", "bfloat16")  # what vLLM and SGLang start with
    lm_head = config.get("lm_head_dtype", engine_dtype)
    if lm_head != engine_dtype:
        shown = "FP32" if lm_head == "float32" else lm_head
        return f"it has no option to run the LM head in {shown} (engine=torch does)"
    eight_bit = quantization is not None or config.get("kv_cache_dtype", "auto") != "auto"
    if eight_bit and engine_dtype == "float32":
        return (
            "its 8-bit GEMMs and caches are not wired or tested with FP32 activations here "
            "(precision.engine_dtype=float32 with 8-bit weights or an FP8 KV cache: "
            "engine=torch)"
        )
    if quantization is not None and quantization not in formats:
        return (
            f"its weight format {quantization!r} is not one this adapter starts and refits "
            f"({', '.join(formats)}); engine=torch runs any policy with a linear_module"
        )
    if quantization == "fp8":
        return _block_fp8_refusal(policy, config.get("quantization_config", {}))
    return None


def _block_fp8_refusal(policy: PrecisionPolicy, quantization_config: dict) -> str | None:
    block = tuple(quantization_config.get("weight_block_size") or (128, 128))
    if block != (128, 128):
        return (
            f"its block-FP8 kernels are built and tested for 128x128 weight blocks; "
            f"precision.block_size={list(block)} runs on engine=torch"
        )
    config = policy.model_config
    if config is None:
        return None
    # The loaders fuse q/k/v and gate/up and split the fused scale grid by block: every
    # part must be whole blocks (checked here, not met as a load error).
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    sizes = {
        "intermediate_size": config.intermediate_size,
        "hidden_size": config.hidden_size,
        "num_attention_heads x head_dim": config.num_attention_heads * head_dim,
        "num_key_value_heads x head_dim": config.num_key_value_heads * head_dim,
    }
    odd = {k: v for k, v in sizes.items() if v % block[0] or v % block[1]}
    if not odd:
        return None
    return (
        f"its block-FP8 loader needs every fused projection in whole {block[0]}x{block[1]} "
        "blocks, and this model's "
        + ", ".join(f"{k} = {v}" for k, v in odd.items())
        + " is not; engine=torch pads odd shapes"
    )


def policy_checkpoint(policy: PrecisionPolicy, source: Path, export_dir: str | None) -> Path:
    """`source` itself when the policy has no checkpoint format and runs the dtype the
    source is stored in, else `source` exported in the policy's format (quantized weights,
    the layers it leaves unquantized listed as ignored, KV-scale parameters; or only cast,
    FP16) to `export_dir` or a directory beside it named after the source, the policy and
    the format."""
    if policy.model_config is None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(source, local_files_only=True))
    config = policy.checkpoint_config(unquantized_layers(policy, source))
    dtype = dtype_name(policy.engine_dtype)
    if not config and stored_dtype(source) == dtype:
        return source
    # A quantized format, or the model's tensors in another dtype (FP16 from a BF16 model):
    # versions are checked against the checkpoint's dtypes.
    key = hashlib.sha256(f"{source.resolve()}:{policy.spec}:{config}:{dtype}".encode()).hexdigest()
    out = (
        Path(export_dir)
        if export_dir
        else source.parent / f".{source.name}-{policy.name}-{key[:12]}"
    )
    if not (out / "config.json").is_file():
        export_checkpoint(policy, source, out, require_calibration=False)
    return out


def stored_dtype(model_dir: Path) -> str | None:
    """The dtype a model directory's config.json says its tensors are stored in."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype")


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
