"""FP16: the weights as the learner has them, cast to float16, and the engine computing in it.

FP16 rounds 8x finer than BF16, at the price of range (65504): a weight beyond it is refused
here, naming the tensor, before the version leaves the learner (docs/precision.md, "FP16")."""

from __future__ import annotations

import torch

from .policy import PrecisionPolicy, dtype_name
from .registry import register_policy
from .storage import Storage

FP16_MAX = torch.finfo(torch.float16).max  # 65504


def check_fp16_range(name: str, tensor: torch.Tensor, cast: torch.Tensor) -> None:
    """Refuses (ValueError naming `name`) a tensor whose FP16 `cast` is not finite: values
    past 65504 (strictly, from 65520 on, where round-to-nearest stops landing on 65504),
    or a NaN / Inf already in `tensor`."""
    if bool(torch.isfinite(cast).all()):
        return
    overflow = torch.isinf(cast) & torch.isfinite(tensor)
    if overflow.any():
        first = overflow.nonzero()[0].tolist()
        largest = tensor[overflow].abs().max().item()
        raise ValueError(
            f"{name}: {int(overflow.sum())} value(s) beyond FP16's range (|x| up to "
            f"{largest:.6g} > {FP16_MAX:g}, first at {first}); precision=fp16 would run them as "
            "inf: use precision=bf16 for this model"
        )
    bad = ~torch.isfinite(tensor)
    raise ValueError(
        f"{name}: {int(bad.sum())} non-finite value(s) (first at {bad.nonzero()[0].tolist()}); "
        "refusing to publish them (with precision.quantize_from=compute and "
        "run.compute_dtype=float16 a value past FP16's range, 65504, arrives here as inf)"
    )


@register_policy("fp16")
class FP16Policy(PrecisionPolicy):
    """Identity in FP16: every floating-point tensor cast to float16 (from the learner's
    FP32 masters), the engine and the refit probe's reference computing in float16, no
    calibration; vLLM is started with `dtype=float16` from an FP16 copy of the model."""

    name = "fp16"
    engine_dtype = torch.float16

    def set_engine_dtype(self, dtype: torch.dtype) -> None:
        if dtype != torch.float16:
            raise ValueError(
                f"precision=fp16 computes in float16; precision.engine_dtype={dtype_name(dtype)} "
                "would make it another precision (use precision=bf16 with that engine_dtype)"
            )

    def passthrough(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor
        cast = tensor.to(self.engine_dtype)
        check_fp16_range(name, tensor, cast)
        return cast

    def storage(self) -> Storage:
        # FP16 tensor cores run at the BF16 rate on every GPU the planner knows.
        return Storage(weight_dtype=torch.float16, kv_dtype=torch.float16, compute="bf16")
