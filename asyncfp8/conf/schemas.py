"""The types of every setting of `run`, `optim`, `sync`, `eval`, `guard` and `engine`, as schemas
in Hydra's ConfigStore (`schema/<group>`, `schema/engine/<name>`), which the YAML files
of those groups extend: a typo or a value of the wrong type fails when the config is
composed, naming the key (`sync.chunk_mb=big`: "Value 'big' ... could not be converted
to Float ... full_key: sync.chunk_mb"), before any process starts.

The values live in the YAML files, with their comments; here every field is MISSING so
that no default is written twice. What a type cannot say (a count >= 1, a rule between
two keys) is checked once, in asyncfp8/checks.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


class Schedule(enum.StrEnum):
    constant = "constant"
    cosine = "cosine"  # to 10% of lr at run.steps


class Loss(enum.StrEnum):
    ppo_clip = "ppo_clip"
    reinforce = "reinforce"


class Aggregation(enum.StrEnum):
    token_mean = "token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_mean = "seq_mean_token_mean"


class AdvantageScale(enum.StrEnum):
    std = "std"  # GRPO
    none = "none"  # Dr. GRPO


class KLEstimator(enum.StrEnum):
    k1 = "k1"
    k3 = "k3"
    low_var_kl = "low_var_kl"


class Transport(enum.StrEnum):
    auto = "auto"
    shm = "shm"
    tcp = "tcp"


class ComputeDtype(enum.StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Placement(enum.StrEnum):
    auto = "auto"
    separate = "separate"
    colocated = "colocated"


class Device(enum.StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class WandbConfig:
    project: str = MISSING
    entity: str | None = MISSING
    name: str | None = MISSING
    group: str | None = MISSING
    tags: list[str] = MISSING
    mode: str = MISSING  # auto | online | offline | disabled (asyncfp8/report/metrics.py)


@dataclass
class RayActorConfig:
    """One learner rank's or one worker's share of a Ray cluster (asyncfp8/launch/ray_cluster.py)."""

    num_cpus: float = MISSING
    num_gpus: float = MISSING
    resources: Any = MISSING  # null, or custom node resources: {rollout: 1}
    strategy: str = MISSING  # learner: PACK, STRICT_PACK, ...; worker: SPREAD, DEFAULT


@dataclass
class RunConfig:
    mode: str = MISSING  # async | sync (checks.max_staleness_of: "async" is no enum name)
    placement: Placement = MISSING  # learner/colocated.py
    release_engine_memory: Any = MISSING  # auto | true | false (checks.release_engine_memory)
    steps: int = MISSING
    groups_per_step: int = MISSING
    group_size: int = MISSING
    max_staleness: int | None = MISSING
    lease_groups: int = MISSING
    lease_timeout: float = MISSING
    temperature: float = MISSING
    max_new_tokens: int = MISSING
    seed: int = MISSING
    workers: int | None = MISSING  # null: process.worker_count
    learner_procs: int = MISSING
    slurm: Any = MISSING  # auto | true | false (asyncfp8/launch/slurm.py)
    ray: bool = MISSING  # asyncfp8/launch/ray_cluster.py
    ray_address: str | None = MISSING
    ray_learner: RayActorConfig = field(default_factory=RayActorConfig)
    ray_worker: RayActorConfig = field(default_factory=RayActorConfig)
    ray_timeout: float = MISSING
    ray_learner_restarts: int = MISSING
    device: Device = MISSING
    compute_dtype: ComputeDtype = MISSING
    dist_timeout: float = MISSING
    inflight_updates: bool = MISSING
    dynamic_sampling: bool = MISSING
    worker_restarts: int = MISSING
    threads: int | None = MISSING
    worker_id: str | None = MISSING
    dir: str = MISSING
    resume: bool = MISSING
    force_resume: bool = MISSING
    checkpoint_every: int = MISSING
    keep_checkpoints: int = MISSING
    export_every: int = MISSING
    worker_wait_timeout: float = MISSING
    loggers: Any = MISSING  # a list, or one name (run.loggers=wandb): asyncfp8/report/metrics.py
    tensorboard: Any = MISSING  # auto | true | false (checks.check_config)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class LossScaleConfig:
    """`optim.loss_scale.*`: dynamic loss scaling with run.compute_dtype=float16
    (asyncfp8/train/loss_scale.py checks the ranges, naming the key)."""

    init: float = MISSING
    growth_interval: int = MISSING
    max_skipped: int = MISSING


@dataclass
class OptimConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING
    eps: float = MISSING
    grad_clip: float = MISSING
    warmup_steps: int = MISSING
    schedule: Schedule = MISSING
    loss: Loss = MISSING
    clip_low: float = MISSING
    clip_high: float = MISSING
    aggregation: Aggregation = MISSING
    advantage_scale: AdvantageScale = MISSING
    clip_ratio_c: float | None = MISSING
    mini_batches: int = MISSING
    ppo_epochs: int = MISSING
    kl_coef: float = MISSING
    kl_estimator: KLEstimator = MISSING
    entropy_coef: float = MISSING
    micro_batch_tokens: int | None = MISSING
    logprob_chunk_tokens: int = MISSING
    activation_checkpointing: bool = MISSING
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)


@dataclass
class ProbeConfig:
    enabled: bool = MISSING
    sequences: int = MISSING
    tokens: int = MISSING
    mean_abs: float | None = MISSING
    max_abs: float | None = MISSING


@dataclass
class CurveConfig:
    enabled: bool = MISSING
    keys_dir: str | None = MISSING


@dataclass
class SyncConfig:
    host: str = MISSING
    bind: str = MISSING
    version_port: int = MISSING
    snapshot_port: int = MISSING
    trajectory_port: int = MISSING
    every: int = MISSING
    transport: Transport = MISSING
    chunk_mb: float = MISSING
    zstd_level: int = MISSING
    background: bool = MISSING
    max_trajectory_mb: float = MISSING
    connect_timeout: float = MISSING
    learner_timeout: float = MISSING
    resend_after: float = MISSING
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    curve: CurveConfig = field(default_factory=CurveConfig)


@dataclass
class EvalConfig:
    every: int = MISSING
    prompts: int = MISSING
    samples: int = MISSING


@dataclass
class SpeculativeConfig:
    """`engine.speculative` (asyncfp8.engines.speculative.settings checks what types cannot)."""

    mode: Any = MISSING  # none | fixed | adaptive; false or null mean none (settings.py)
    draft_tokens: int = MISSING
    threshold: int = MISSING
    patience: int = MISSING
    ks: list[int] = MISSING
    train_steps: int = MISSING
    train_time_fraction: float | None = MISSING
    lr: float = MISSING
    batch_size: int = MISSING
    init: str | None = MISSING
    seed: int = MISSING


@dataclass
class TorchEngineConfig:
    name: str = MISSING
    max_batch: int = MISSING
    device: str = MISSING  # auto | cpu | cuda | cuda:N
    finish_check_every: int = MISSING
    cache_block: int = MISSING
    cuda_graph: bool = MISSING
    slots: int | None = MISSING
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class VLLMEngineConfig:
    name: str = MISSING
    max_model_len: int | None = MISSING
    kv_cache_gib: int = MISSING  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    enforce_eager: bool = MISSING
    seed: int = MISSING
    gpu_memory_utilization: float | None = MISSING


@dataclass
class SGLangEngineConfig:
    name: str = MISSING
    seed: int = MISSING
    mem_fraction_static: float = MISSING


@dataclass
class GuardConfig:
    """`guard.*` (asyncfp8/train/guard.py checks the ranges, naming the key)."""

    enabled: bool = MISSING
    max_rollbacks: int = MISSING
    log_ratio_bound: float = MISSING
    far_tokens: int = MISSING
    far_fraction: float = MISSING
    reward_good: float = MISSING
    window: int = MISSING
    keep_states: int = MISSING
    dead_batches: int = MISSING
    reward_low: float = MISSING
    shrink: float = MISSING
    shrink_steps: int = MISSING
    heldout_below: float = MISSING


SCHEMAS = {
    "run": RunConfig,
    "optim": OptimConfig,
    "sync": SyncConfig,
    "eval": EvalConfig,
    "guard": GuardConfig,
}
ENGINE_SCHEMAS = {
    "torch": TorchEngineConfig,
    "vllm": VLLMEngineConfig,
    "sglang": SGLangEngineConfig,
}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in SCHEMAS.items():
        store.store(group="schema", name=group, node=schema)
    for name, schema in ENGINE_SCHEMAS.items():
        store.store(group="schema/engine", name=name, node=schema)
