"""An RL step end to end: rollout, learner, and publishing the new weights.

Synchronous: rollout (tail included), then the learner, then quantize, send and apply the
version. Asynchronous with bounded staleness: the longer of the engines' steady stream and
the learner's side. A version is full or a delta (docs/plan.md, "The model", "RL step")."""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration
from .costs import weight_bytes
from .gpus import GPU
from .model import ModelFacts
from .precisions import Precision

BF16_BYTES = 2


@dataclass(frozen=True)
class WeightSync:
    mode: str  # full or delta
    wire_bytes: float
    quantize_s: float  # on the learner, before sending
    transfer_s: float
    apply_s: float  # the engine copies the version into place (paused)

    @property
    def seconds(self) -> float:
        return self.quantize_s + self.transfer_s + self.apply_s


def weight_sync(
    model: ModelFacts,
    precision: Precision,
    gpu: GPU,
    calibration: Calibration,
    mode: str,
    link_gb_s: float,
    changed_fraction: float,
    tp: int,
) -> WeightSync:
    full = weight_bytes(model, precision)
    wire = full
    if mode == "delta":
        wire = full * changed_fraction * calibration.delta_bytes_ratio(precision.weights)
    rate = link_gb_s * 1e9
    measured = calibration.sync.get("publish_to_applied_gb_s", {}).get(precision.weights)
    if measured:  # the whole path as measured on this device: codec and sockets included
        rate = min(rate, measured * 1e9)
    eff = calibration.efficiency
    quantize_s = 0.0
    if precision.weights != "bf16":
        bf16_bytes = model.parameter_count() * BF16_BYTES
        measured_quantize = calibration.quantize_gb_s.get(precision.weights)
        if measured_quantize:
            quantize_s = bf16_bytes / (measured_quantize * 1e9)
        else:
            # A bandwidth-bound kernel on the learner's GPU: read 2 bytes, write ~1. A
            # delta costs as much: every element is quantized to find those that changed.
            quantize_s = 1.5 * bf16_bytes / (gpu.bandwidth * eff.memory)
    apply_s = wire / tp / (gpu.bandwidth * eff.memory)
    return WeightSync(mode, wire, quantize_s, wire / rate, apply_s)


def proximal_versions_bytes(model: ModelFacts, max_staleness: int) -> int:
    """Host memory the learner takes to keep the versions π_prox is computed under
    (`correction.proximal=version`, the default on one rank): an FP32 copy of every
    parameter for each of the last `max_staleness` + 1 versions, and one for the swaps
    (`asyncfp8.train.versions.kept_bytes` of the learner's `keep`, which the tests hold
    this to)."""
    return 4 * model.parameter_count() * (max_staleness + 2)


def learner_step_seconds(
    model: ModelFacts,
    sequence_lengths,
    gpu: GPU,
    gpus: int,
    mfu: float,
    passes: float,
) -> float:
    """Training on a step's samples from FLOPs: `passes` forward-equivalents (forward +
    backward = 3, plus one per logprob recompute) of every sequence, at `mfu` of the
    learner GPUs' BF16 peak. Causal attention over each sequence is counted."""
    lengths = [float(n) for n in sequence_lengths]
    linear = 2.0 * model.active_parameter_count() * sum(lengths)
    attention = 2.0 * model.num_layers * model.q_size * sum(n * (n + 1) for n in lengths)
    return passes * (linear + attention) / (gpus * gpu.peak_flops("bf16") * mfu)


def step_times(
    rollout_sync_s: float,
    rollout_stream_s: float,
    learner_s: float,
    sync: WeightSync,
    max_staleness: int,
) -> dict[str, float]:
    """Seconds per RL step, synchronous and asynchronous (max_staleness >= 1)."""
    synchronous = rollout_sync_s + learner_s + sync.seconds
    if max_staleness < 1:
        asynchronous = synchronous
    else:
        engine_side = rollout_stream_s + sync.apply_s
        learner_side = learner_s + sync.quantize_s + sync.transfer_s
        asynchronous = max(engine_side, learner_side)
    return {
        "step_sync_s": synchronous,
        "step_async_s": asynchronous,
        "async_speedup": synchronous / asynchronous,
    }
