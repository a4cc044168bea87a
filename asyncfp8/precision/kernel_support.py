"""What every format's kernels share: whether Triton can run on a tensor, how a path is
chosen (`impl`), the error raised when the device can run none of a kernel's paths, the
GEMM tiling, and the exact roundings (half to even, to the e4m3 grid) that let a Triton
kernel give its torch reference's bytes. Triton runs on CUDA, and on the CPU under
`TRITON_INTERPRET=1` (set before triton is imported); `ASYNCFP8_TRITON=0` turns it off."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the `triton` extra is optional
    triton = None
    tl = None


#: What the GEMMs (fp8/gemm.py, int8/gemm.py) can write their output in.
GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Triton is installed, not turned off, and can launch on this tensor's device."""
    if triton is None or os.environ.get("ASYNCFP8_TRITON", "1") == "0":
        return False
    return tensor.is_cuda or (tensor.device.type == "cpu" and interpreting())


def triton_enabled(tensor: torch.Tensor) -> bool:
    """Whether a weight quantizer takes its Triton kernel: on CUDA only (under the
    interpreter, the tests call the kernels themselves)."""
    return tensor.is_cuda and triton_runs_on(tensor)


def launching_on(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes a CUDA `device` the thread's current device for the block (a CPU: nothing).
    Triton kernels launch, and CUDA graphs capture and replay, on the current device, not
    on their tensors': an engine on cuda:1 driven by a thread whose current device is
    cuda:0 (a worker's main thread, a colocated learner's) would launch there otherwise."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_its_device(method):
    """A method of an object with a `device` that runs under `launching_on(self.device)`."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with launching_on(self.device):
            return method(self, *args, **kwargs)

    return run


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


def divide_exactly(tensor: torch.Tensor, constant: float) -> torch.Tensor:
    """tensor / constant, correctly rounded on every device. torch's CUDA kernel divides
    by a Python number as a product with its reciprocal, one ulp off at times: the GPU
    references then differed from the Triton kernels' `div_rn` and from the CPU (seen
    on an H100, torch 2.11). A divisor tensor on the same device takes the true division,
    and `full_like` fills it on the device (a CUDA-graph capture allows that)."""
    return tensor / torch.full_like(tensor, constant)


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


def gemm_tiles(m: int, n: int, k_tiles: int, device: DeviceFacts, split_k: int | None):
    """(block_m, block_n, K splits, K tiles per split) of a Triton GEMM over an [m, K] x
    [K, n] product of `k_tiles` K tiles, on `device`."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 16 else 128
    if not device.cuda:
        block_n = 32  # the interpreter runs tiles element by element: keep them small
    grid_mn = ceil_div(m, block_m) * ceil_div(n, block_n)
    if split_k is None:
        # Decode (small M) has few output tiles: split K until about two programs run
        # per multiprocessor, each on at least 4 K tiles, so the weight streams in at
        # full bandwidth. The partial sums are added in a fixed order (deterministic).
        want = ceil_div(2 * device.multiprocessors, grid_mn)
        split_k = max(1, min(want, k_tiles // 4))
    split_k = max(1, min(split_k, k_tiles))
    per_split = ceil_div(k_tiles, split_k)
    return block_m, block_n, ceil_div(k_tiles, per_split), per_split


def fused_tiles(m: int, n: int, device: DeviceFacts) -> tuple[int, int]:
    """(block_m, block_n): the widest N tile that still gives every multiprocessor a
    program (decode has one M tile; without K splits, narrow N tiles fill the GPU)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if not device.cuda:
        return block_m, 32  # the interpreter runs tiles element by element
    for block_n in (128, 64, 32):
        if ceil_div(m, block_m) * ceil_div(n, block_n) >= device.multiprocessors:
            return block_m, block_n
    return block_m, 16


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What a kernel's launch reads of its device, read once per layer (host queries in
    a compiled decode step would break its graph)."""

    cuda: bool
    multiprocessors: int
    fp8_mma: bool  # sm89 or later: tensor cores take e4m3 operands

    @classmethod
    def of(cls, tensor: torch.Tensor) -> DeviceFacts:
        fp8 = tensor.is_cuda and torch.cuda.get_device_capability(tensor.device) >= (8, 9)
        return cls(tensor.is_cuda, multiprocessors(tensor), fp8 or not tensor.is_cuda)


if triton is not None:

    @triton.jit
    def round_half_even(x):
        floor = tl.floor(x)
        frac = x - floor
        odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
        return tl.where(up, floor + 1.0, floor)

    @triton.jit
    def round_to_e4m3_grid(x):
        # Round an fp32 already in [-448, 448] to the nearest e4m3 value (ties to even)
        # in fp32, so that the cast after it is exact. The cast alone would round too, but
        # Triton's interpreter drops the carry into the exponent (31.8 -> 16, not 32),
        # and the kernels must match the torch references bit for bit everywhere.
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        # e4m3 has 3 mantissa bits; below 2^-6 its values are subnormal, spaced 2^-9.
        step_exponent = tl.maximum(exponent, -6) - 3
        step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
        rounded = round_half_even(x / step) * step
        return tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of zero: -0.0001 -> -0
