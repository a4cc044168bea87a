"""The learner as one or N processes on PyTorch's own distributed engine.

    torchrun --nproc_per_node 4 -m asyncfp8.learner ...  # or python -m asyncfp8.learner: one

FSDP2, rank 0 owning the sockets (docs/running.md, 'The learner on several GPUs').
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from asyncfp8.run.process import die_with_parent

DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,  # with dynamic loss scaling (asyncfp8/train/loss_scale.py)
}

# The TF32 switches as a CUDA learner found them (None: it did not touch them); `close`
# puts them back.
_tf32_before: tuple[bool, bool] | None = None


@dataclass(frozen=True)
class Ranks:
    """This process's place in the learner's process group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def resolve_device(setting: str) -> torch.device:
    """`run.device`: auto (CUDA when there is a GPU), cpu or cuda."""
    if setting not in DEVICES:
        raise ValueError(f"run.device must be one of {', '.join(DEVICES)}, got {setting!r}")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "run.device=cuda but torch sees no CUDA GPU (a CPU build of torch, no driver, or "
            "CUDA_VISIBLE_DEVICES hides them): use run.device=cpu or run.device=auto"
        )
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(setting)


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`run.compute_dtype`: auto is BF16 on GPUs (FP32 master weights and gradient
    reduction all the same) and FP32 on CPUs; float16 computes in FP16 on the same FP32
    masters, its loss scaled (the train step's LossScaler)."""
    if setting not in COMPUTE_DTYPES:
        raise ValueError(
            f"run.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {setting!r}"
        )
    chosen = COMPUTE_DTYPES[setting]
    if chosen is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return chosen


def start(device_setting: str, timeout_s: float) -> Ranks:
    """Joins (or, without torchrun, makes) the learner's process group."""
    device = resolve_device(device_setting)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
                "visible): start at most one learner process per GPU (--nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if not dist.is_nccl_available():
            raise ValueError(
                "this torch build has no NCCL, which the learner needs between GPUs: install a "
                "CUDA build of torch with NCCL, or run the learner on CPUs (run.device=cpu)"
            )
        _use_tf32()
    # Object collectives and scalar sums run on CPU tensors (gloo) next to NCCL.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if under_torchrun:
            die_with_parent()  # this rank goes when its torchrun agent goes
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _use_tf32() -> None:
    """TF32 for FP32 matmuls (the master-weight paths; BF16 compute is unaffected) until
    `close`. The switches are the process's: left on, they would also round the FP32
    matmuls of whatever runs after the learner in it (a test of FP32 decoding)."""
    global _tf32_before
    if _tf32_before is None:
        _tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def _restore_tf32() -> None:
    global _tf32_before
    if _tf32_before is not None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = _tf32_before
        _tf32_before = None


def _checkpointed(layer: nn.Module) -> None:
    """The layer's forward recomputed in the backward pass instead of keeping its
    activations. Only `forward` is wrapped: the sharding hooks around it still gather the
    layer's weights before the recompute, and parameter names do not change."""
    forward = layer.forward

    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = recomputed


def shard(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    frozen: bool = False,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """FSDP2 over every rank: each decoder layer (`model._no_split_modules`) is a unit,
    the root holds the rest (embeddings, final norm, output layer). Master weights stay
    FP32 (a frozen reference model is kept in `dtype` itself); forward and backward run
    in `dtype`; gradients are reduced in FP32 and summed, not averaged, over ranks (the
    loss is normalized by global token counts: `scale_gradients`)."""
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules): the "
            "learner cannot shard it layer by layer"
        )
    if activation_checkpointing:
        for layer in layers:
            _checkpointed(layer)
    # fully_shard moves each unit to the mesh's device as it shards it: the whole model is
    # never on the GPU unsharded.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if frozen:
        model.to(dtype=dtype)
        policy = MixedPrecisionPolicy()
    else:
        # Lower-precision compute: gradients are still reduced (and kept) in FP32.
        # FP32 compute: no casting at all, reduced in the masters' own dtype.
        policy = MixedPrecisionPolicy()
        if dtype != torch.float32:
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain sum (gloo has no pre-multiplied sum; a factor of 1 divides by nothing).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def world_size() -> int:
    """The process group's size; 1 without one (a train step run on its own, in a test)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def scale_gradients(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every rank (float64, on the CPU: gloo even beside NCCL).
    Every rank passes the same keys."""
    keys = sorted(values)
    tensor = torch.tensor([values[key] for key in keys], dtype=torch.float64)
    if world_size() > 1:
        dist.all_reduce(tensor)
    return dict(zip(keys, tensor.tolist(), strict=True))


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value's maximum over every rank (same keys on every rank)."""
    keys = sorted(values)
    tensor = torch.tensor([values[key] for key in keys], dtype=torch.float64)
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(keys, tensor.tolist(), strict=True))


def new_group(timeout_s: float) -> Any:
    """A second gloo group over every rank (collective: every rank makes it, in the same
    order), for a thread whose collectives run beside the training loop's (a colocated
    run's rollout threads), giving up after `timeout_s` as the learner's do; None
    without a process group of several ranks."""
    if world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj`, on every rank."""
    box = [obj]
    if world_size() > 1:
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


def scatter(per_rank: list[Any] | None, group: Any = None) -> Any:
    """Rank r gets `per_rank[r]` of rank 0's list (others pass None), over `group`
    (default: the learner's)."""
    if world_size() == 1:
        return per_rank[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, per_rank if dist.get_rank() == 0 else None, src=0, group=group)
    return box[0]


def gather(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere), over `group`."""
    if world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) tensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def resharded(model: nn.Module) -> nn.Module:
    """`model` with every FSDP2 unit's parameters sharded: what anything that writes the
    weights outside the optimizer (a rollback, a version's swap) must write. After a forward
    without gradients FSDP2 leaves the root unit unsharded and the next forward reuses that
    copy, so a write into the copy or into the shards alone would reach only one of them
    (docs/running.md, 'The learner on several GPUs')."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def full_state_dict(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole model, gathered to rank 0's CPU (an empty dict on the other ranks), or
    with `every_rank` to every rank's CPU (a colocated run: each rank's engine takes the
    version from it; gathered one tensor at a time, so a GPU holds one whole tensor at
    most beside its shards). Collective. Tied weights appear under each of their names."""
    if every_rank and world_size() > 1:
        return {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            for name, t in model.state_dict().items()
        }
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank writes its shards (collective); readable at any world size. An
    optimizer that has not stepped yet holds no state and is left out (reading its state
    dict would initialize it with a step of zeros)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Reads a `save_checkpoint` directory into this rank's shards (collective)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


@contextlib.contextmanager
def memory_advice(what: str, settings: dict[str, Any]) -> Iterator[None]:
    """An out-of-memory error becomes a message naming the settings that bound memory."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not isinstance(err, torch.OutOfMemoryError) and "allocate" not in str(err):
            raise
        now = ", ".join(f"{key}={value}" for key, value in settings.items())
        raise MemoryError(
            f"learner rank {dist.get_rank() if dist.is_initialized() else 0}: out of memory in "
            f"{what} ({now}). Lower optim.micro_batch_tokens, turn on "
            "optim.activation_checkpointing=true, lower optim.logprob_chunk_tokens, or "
            f"spread the model over more ranks (run.learner_procs). {err}"
        ) from None


def close() -> None:
    """Leaves the process group and puts back what `start` changed for the process."""
    _restore_tf32()
    if dist.is_initialized():
        # Every rank waits for the others first: a rank that destroys the group while a peer
        # is still finishing the last collective (the final export's gather, which rank 0
        # follows with minutes of writing) can abort gloo (SIGABRT seen in CI); torch asks
        # that no collective be in flight when the group is destroyed.
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Ends a process that joined a process group: its exit handlers run with the interpreter
    whole, then it exits without Python's finalization. Gloo's worker threads outlive
    `destroy_process_group` (FSDP's meshes hold the group), and one releasing a finished
    collective's tensors while the interpreter is torn down aborts the process (SIGABRT,
    "terminate called without an active exception"; docs/testing.md)."""
    # logging's shutdown, W&B, the tasks' helpers, as sys.exit would run them; threads are
    # not joined (the learner's are daemons)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
