"""Accelerators the planner knows: published datasheet figures, dense (no 2:4 sparsity).

`gpu=<name>` picks one of the table; any other GPU is given by its numbers, inline or as a
JSON/YAML file with the fields of `GPU` (docs/plan.md, "Inputs", says how and in what
units; without FP8 tensor cores FP8 runs weight-only)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from .errors import PlanInputError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """Datasheet figures: memory in GiB (a datasheet's "GB" of HBM), bandwidth in TB/s
    (1e12 bytes/s), dense tensor-core rates (`None`: no such tensor cores), and one direction
    of the GPU-GPU link tensor parallelism uses (NVLink, or PCIe without it)."""

    name: str
    memory_gb: float
    bandwidth_tb_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    int8_tops: float | None
    link_gb_s: float
    source: str = "custom"

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GIB

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_tb_s * 1e12

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for GEMMs whose inputs are `dtype`; a type without tensor-core
        support runs at the BF16 rate (its weights are widened on the fly)."""
        rate = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops}[dtype]
        return (rate or self.bf16_tflops) * 1e12

    def has_tensor_cores_for(self, dtype: str) -> bool:
        return dtype == "bf16" or bool({"fp8": self.fp8_tflops, "int8": self.int8_tops}.get(dtype))


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "h100",
            memory_gb=80,
            bandwidth_tb_s=3.35,
            bf16_tflops=989.4,
            fp8_tflops=1978.9,
            int8_tops=1978.9,
            link_gb_s=450,
            source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (BF16 1,979 / "
            "FP8 3,958 / INT8 3,958 with sparsity, halved here; 3.35 TB/s HBM3; NVLink "
            "900 GB/s both directions)",
        ),
        GPU(
            "h200",
            memory_gb=141,
            bandwidth_tb_s=4.8,
            bf16_tflops=989.4,
            fp8_tflops=1978.9,
            int8_tops=1978.9,
            link_gb_s=450,
            source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (same tensor "
            "cores as H100 SXM; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s both directions)",
        ),
        GPU(
            "b200",
            memory_gb=180,
            bandwidth_tb_s=8.0,
            bf16_tflops=2250,
            fp8_tflops=4500,
            int8_tops=4500,
            link_gb_s=900,
            source="NVIDIA DGX B200 datasheet, per GPU (8 GPUs: 1,440 GB HBM3e, 64 TB/s; "
            "FP8 72 PFLOPS and FP16/BF16 36 PFLOPS with sparsity, halved here; INT8 as "
            "FP8); NVLink 5 1.8 TB/s both directions",
        ),
        GPU(
            "a100",
            memory_gb=80,
            bandwidth_tb_s=2.039,
            bf16_tflops=312,
            fp8_tflops=None,
            int8_tops=624,
            link_gb_s=300,
            source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (BF16 312, "
            "INT8 624 dense; no FP8; 2,039 GB/s HBM2e; NVLink 600 GB/s both directions)",
        ),
        GPU(
            "l40s",
            memory_gb=48,
            bandwidth_tb_s=0.864,
            bf16_tflops=362.05,
            fp8_tflops=733,
            int8_tops=733,
            link_gb_s=32,
            source="NVIDIA L40S datasheet (BF16 362.05, FP8 733, INT8 733 dense; 48 GB "
            "GDDR6 at 864 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s both directions)",
        ),
    )
}

HOW_TO_CUSTOM = (
    "give a GPU that is not in the table by its numbers: "
    "gpu={name:mygpu,memory_gb:96,bandwidth_tb_s:4.0,bf16_tflops:900,fp8_tflops:1800,"
    "int8_tops:1800,link_gb_s:450} (fp8_tflops/int8_tops may be null), or gpu=<file.json|yaml> "
    "with those keys"
)


def _from_mapping(spec: Mapping[str, Any], where: str) -> GPU:
    known = {f.name for f in fields(GPU)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise PlanInputError(f"GPU spec {where}: unknown keys {unknown}; {HOW_TO_CUSTOM}")
    required = ["memory_gb", "bandwidth_tb_s", "bf16_tflops", "link_gb_s"]
    missing = [key for key in required if spec.get(key) is None]
    if missing:
        raise PlanInputError(f"GPU spec {where}: missing {missing}; {HOW_TO_CUSTOM}")
    values = {key: spec.get(key) for key in known if key in spec}
    values.setdefault("name", "custom")
    values.setdefault("fp8_tflops", None)
    values.setdefault("int8_tops", None)
    for key in (
        "memory_gb",
        "bandwidth_tb_s",
        "bf16_tflops",
        "link_gb_s",
        "fp8_tflops",
        "int8_tops",
    ):
        value = values[key]
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise PlanInputError(
                f"GPU spec {where}: {key} must be a positive number, got {value!r}"
            )
    return GPU(**values)


def get_gpu(spec: str | Mapping[str, Any]) -> GPU:
    """A GPU by table name, inline mapping, or a JSON/YAML file of the same keys."""
    if isinstance(spec, Mapping):
        return _from_mapping(spec, "given inline")
    key = str(spec).lower()
    if key in GPUS:
        return GPUS[key]
    path = Path(str(spec)).expanduser()
    if path.suffix in (".json", ".yaml", ".yml") and path.is_file():
        text = path.read_text()
        try:
            loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as err:
            raise PlanInputError(f"GPU spec {path}: cannot parse ({err})") from None
        if not isinstance(loaded, Mapping):
            raise PlanInputError(f"GPU spec {path}: expected a mapping of GPU numbers")
        return _from_mapping(loaded, str(path))
    raise PlanInputError(f"unknown GPU {spec!r}; known: {', '.join(GPUS)}. Or {HOW_TO_CUSTOM}")
