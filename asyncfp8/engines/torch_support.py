"""What the torch engine refuses at start, saying why and what runs instead: a device torch
cannot serve (`resolve_device`), a policy without runtime modules (`supports`), option
values, models with layers that do not attend to the full context, and (`probe`) a kernel
the device cannot run for the precision."""

from __future__ import annotations

import os
import re
import shutil

import torch

from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.kernel_support import KernelUnavailable, describe_device

from .base import EngineUnsupported
from .decode import LAYER_KINDS, Prefill

DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(device: str, precision: str) -> torch.device:
    """`auto` (the GPU when torch sees one, else the CPU), `cpu`, `cuda` or `cuda:N`;
    a GPU torch cannot see is refused, saying what runs instead."""
    if not isinstance(device, str) or not DEVICE.match(device):
        raise ValueError(f"engine.device must be auto, cpu, cuda or cuda:N; got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineUnsupported(
                f"engine torch: engine.device={device} but torch {torch.__version__} sees no "
                f"CUDA GPU; engine.device=cpu (or auto) runs precision {precision!r} on the CPU"
            )
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise EngineUnsupported(
                f"engine torch: engine.device={device} but torch sees "
                f"{torch.cuda.device_count()} GPU(s); use cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}, or engine.device=cpu"
            )
        return torch.device("cuda", index)
    return torch.device("cpu")


def supports(policy: PrecisionPolicy) -> str | None:
    """None if the built-in engine can run `policy`, else why not: it runs every policy
    that gives a runtime module for the weights it quantizes. (What the device cannot
    run is found at start, by the probe.)"""
    if policy.quantizes_weights and type(policy).linear_module is PrecisionPolicy.linear_module:
        return (
            f"precision {policy.name!r} quantizes weights but gives the built-in torch engine "
            "no runtime module (PrecisionPolicy.linear_module)"
        )
    return None


def check_counts(**options: object) -> None:
    """ValueError naming the first engine option that is not an int >= 1."""
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"engine.{key} must be an int >= 1, got {value!r}")


def check_layer_kinds(model: torch.nn.Module) -> None:
    """EngineUnsupported for a model with layers that do not attend to the full context
    (sliding windows): the static cache's masks are built per full-attention layer."""
    kinds = set(getattr(model.config, "layer_types", None) or LAYER_KINDS)
    if not kinds <= set(LAYER_KINDS):
        raise EngineUnsupported(
            f"engine torch decodes models whose layers all attend to the full context; "
            f"this one has {sorted(kinds - set(LAYER_KINDS))} layers (engine=vllm runs them)"
        )


def probe(model: torch.nn.Module, precision: str, device: torch.device, token_id: int) -> None:
    """One token through the model: a kernel this device cannot run for this precision
    fails here, at start, rather than at the first generation."""
    token = torch.tensor([[token_id]])
    try:
        Prefill(model, 1, 1).run(token, torch.ones_like(token))
    except KernelUnavailable as err:
        raise EngineUnsupported(
            f"engine torch cannot run precision {precision!r} on "
            f"{describe_device(token.to(device))}: {err}. engine.device=cpu runs "
            "every precision (reference kernels)"
        ) from None


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """engine.compile: true, false, or null (on CUDA, where it fuses the captured graph's
    small kernels, not measured on a GPU yet; on this CPU it did not pay, docs/engines.md).
    True where it cannot run is refused, naming the key and what it lacks."""
    if compile is not None and not isinstance(compile, bool):
        raise ValueError(f"engine.compile must be true, false or null; got {compile!r}")
    if compile is None:
        return device.type == "cuda" and compile_unavailable(device) is None
    if compile and (why := compile_unavailable(device)):
        raise EngineUnsupported(f"engine.compile=true cannot run here: {why}")
    return compile


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile's inductor cannot build a decode step for `device`, or None."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "inductor's CUDA kernels are Triton's, and Triton is not installed"
        return None
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("clang++") is None:
        return f"inductor's CPU kernels need a C++ compiler ({compiler} or clang++), none found"
    return None
