"""Writing a quantized HF checkpoint: the BF16 model streamed through a policy (or only
cast, for FP16), one tensor at a time into shards of at most `shard_bytes`, so that neither
model is ever held whole. Where the result loads: docs/precision.md, "Exported checkpoints".
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncfp8.hf.loading import check_model_dir

from .policy import PrecisionPolicy, dtype_name, is_quantizable

COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def read_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every *.safetensors file of a model directory, one at a time."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def stored_names(model_dir: str | Path) -> list[str]:
    """The tensor names of a model directory's *.safetensors files (no tensor read)."""
    names = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def unquantized_layers(policy: PrecisionPolicy, model_dir: str | Path) -> list[str]:
    """The linear layers of a model that a weight format could quantize but `policy`
    leaves in the engine dtype: the format's ignore list (vLLM's `ignored_layers`,
    compressed-tensors' `ignore`), so an engine loads them as the policy sends them."""
    if not policy.quantizes_weights:
        return []
    return sorted(
        name.removesuffix(".weight")
        for name, tensor in read_tensors(model_dir)
        if is_quantizable(name, tensor) and not policy.quantizes(name, tensor)
    )


def export_checkpoint(
    policy: PrecisionPolicy,
    model_dir: str | Path,
    out_dir: str | Path,
    calibration_batch: Mapping[str, torch.Tensor] | None = None,
    shard_bytes: int = 2 << 30,
    require_calibration: bool = True,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write `model_dir` quantized by `policy` to `out_dir`: the shards, config.json (dtype
    `engine_dtype`, the policy's `quantization_config`) and the tokenizer files.
    `calibration_batch` (input_ids, attention_mask) gives a calibrating policy its extra
    tensors, `require_calibration=False` exports without them, `tensors` replaces the
    weights read from `model_dir` (docs/precision.md, "Exported checkpoints")."""
    source = check_model_dir(model_dir)
    out = Path(out_dir)
    if out.resolve() == source.resolve():
        raise ValueError("export_checkpoint: out_dir must differ from model_dir")
    out.mkdir(parents=True, exist_ok=True)

    extra = _calibrated(policy, source, calibration_batch, require_calibration)
    if policy.model_config is None:
        from transformers import AutoConfig

        policy.bind_model(AutoConfig.from_pretrained(source, local_files_only=True))
    weights = read_tensors(source) if tensors is None else tensors
    _write_shards(
        itertools.chain(policy.quantize_weights(weights), extra.items()), out, shard_bytes
    )
    _write_config(policy, source, out)
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return out


def _calibrated(
    policy: PrecisionPolicy,
    source: Path,
    calibration_batch: Mapping[str, torch.Tensor] | None,
    require_calibration: bool,
) -> dict[str, torch.Tensor]:
    """The policy's extra tensors (KV scales) from `calibration_batch` through the FP32
    model; none without a batch, where the policy allows it."""
    extra: dict[str, torch.Tensor] = {}
    if calibration_batch is not None:
        from asyncfp8.hf.loading import load_model

        extra = policy.calibrate(load_model(source, dtype=torch.float32), calibration_batch)
    elif policy.needs_calibration and require_calibration:
        raise ValueError(
            f"precision {policy.name!r} calibrates (KV scales): pass calibration_batch"
        )
    return extra


def _write_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int
) -> None:
    """Streams the tensors into safetensors shards of at most `shard_bytes` (one tensor
    larger than that gets a shard of its own): model.safetensors, or numbered shards with
    their index."""
    shard: dict[str, torch.Tensor] = {}
    shard_size, shard_files, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(shard_files) + 1:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            shard_files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_size = {}, 0

    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_size + size > shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        shard_size += size
    flush()

    if len(shard_files) == 1:
        (out / shard_files[0]).rename(out / "model.safetensors")
    else:
        index = {
            "metadata": {"total_size": sum((out / f).stat().st_size for f in shard_files)},
            "weight_map": weight_map,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_config(policy: PrecisionPolicy, source: Path, out: Path) -> None:
    """config.json: the source's, with the policy's dtype and `quantization_config`."""
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = dtype_name(policy.engine_dtype)
    if "torch_dtype" in config:  # the name before transformers 4.56
        config["torch_dtype"] = config["dtype"]
    quantization_config = policy.checkpoint_config(unquantized_layers(policy, source))
    if quantization_config:
        config["quantization_config"] = quantization_config
    else:
        config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
