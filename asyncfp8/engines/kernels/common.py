"""What every kernel here shares: whether Triton can run on a tensor, how a path is
chosen (`impl`), and the error raised when the device can run none of a kernel's paths.

Triton runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (set before
triton is imported; the tests run the kernels that way in a subprocess). The variable
`ASYNCFP8_TRITON=0` turns Triton off, as it does for the weight quantizers.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `triton` extra is optional
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Triton is installed, not turned off, and can launch on this tensor's device."""
    if triton is None or os.environ.get("ASYNCFP8_TRITON", "1") == "0":
        return False
    return tensor.is_cuda or (tensor.device.type == "cpu" and interpreting())


def describe_device(tensor: torch.Tensor) -> str:
    if not tensor.is_cuda:
        return str(tensor.device)
    index = tensor.device.index if tensor.device.index is not None else 0
    major, minor = torch.cuda.get_device_capability(index)
    return f"{tensor.device} ({torch.cuda.get_device_name(index)}, sm{major}{minor})"


class KernelUnavailable(RuntimeError):
    """No path of a kernel can run on the given tensors' device."""


def unavailable(kernel: str, tensor: torch.Tensor, why: str, would_work: str) -> KernelUnavailable:
    return KernelUnavailable(
        f"{kernel} cannot run on {describe_device(tensor)}: {why}. What would work: {would_work}"
    )


def why_no_triton(tensor: torch.Tensor) -> str:
    if triton is None:
        return "Triton is not installed"
    if os.environ.get("ASYNCFP8_TRITON", "1") == "0":
        return "Triton is turned off (ASYNCFP8_TRITON=0)"
    return "Triton kernels launch on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)"


def check_impl(impl: str, choices: tuple[str, ...]) -> None:
    if impl not in choices:
        raise ValueError(f"impl must be one of {', '.join(choices)}; got {impl!r}")


def check_2d(name: str, tensor: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...]) -> None:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def multiprocessors(tensor: torch.Tensor) -> int:
    """How many programs fill the device once (streaming multiprocessors on CUDA); the
    interpreter gets a small number so that the tests reach the split code paths."""
    if tensor.is_cuda:
        return torch.cuda.get_device_properties(tensor.device).multi_processor_count
    return 4
