"""Loading an HF model directory with errors that say what is wrong and how to fix it,
instead of a traceback from deep inside transformers or the hub client."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncfp8.hf.directory import check_model_dir, load_tokenizer

from .cpu_half import where_cpu_lacks_gemm

__all__ = ["check_model_dir", "load_model", "load_tokenizer"]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The HF model in `path`, its weights in `dtype`. In BF16 or FP16 on a CPU without
    GEMM kernels for it, its linear layers (up to 2^17 weights) compute each product as one
    FP64 GEMM converted to that format (the exact sum's rounding but for ties and
    cancellation), several times faster there (asyncfp8.hf.cpu_half)."""
    from transformers import AutoModelForCausalLM

    model_dir = check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return where_cpu_lacks_gemm(model, dtype)
