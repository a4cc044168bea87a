"""Loading an HF model directory with errors that say what is wrong and how to fix it,
instead of a traceback from deep inside transformers or the hub client."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncfp8.model_dirs import check_model_dir, load_tokenizer

from .cpu_half import where_cpu_lacks_gemm

__all__ = ["check_model_dir", "load_model", "load_tokenizer", "resolve_model_dir", "run_model_dir"]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The HF model in `path`, its weights in `dtype`. In BF16 or FP16 on a CPU without
    GEMM kernels for it, its linear layers (up to 2^17 weights) compute each product as one
    FP64 GEMM converted to that format (the exact sum's rounding but for ties and
    cancellation), several times faster there (asyncfp8.models.cpu_half)."""
    from transformers import AutoModelForCausalLM

    model_dir = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return where_cpu_lacks_gemm(model, dtype)


def resolve_model_dir(path: str | None, size: str = "tiny", seed: int = 0, task=None) -> Path:
    """The model a run uses: `path` when given (checked), else the locally made tiny
    model of that size and seed, warm-started on the run's task config `task` where the
    factory knows how (asyncfp8.models.tiny.warm_start_task): shipped with the package,
    or built on first use and cached."""
    if path:
        return check_model_dir(path)
    from .tiny import make_tiny_model, warm_start_task

    return make_tiny_model(size, seed=seed, task=warm_start_task(task))


def run_model_dir(cfg) -> Path:
    """The model directory of a run's config (`model` and `task` groups)."""
    return resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed, cfg.get("task"))
