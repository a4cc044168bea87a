"""The learner's parts, each made from the config by one small builder, so that
`Learner.__init__` reads as the list of what a learner has. Every builder takes what it
needs and returns one part (or None where the config turns that part off)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from asyncfp8.checks import release_engine_memory
from asyncfp8.correction.calibration import BoundCalibration
from asyncfp8.correction.registry import Correction
from asyncfp8.engines import build_engine
from asyncfp8.learner.colocated import COLOCATED_VLLM_MEMORY, Colocated, kept_random_state
from asyncfp8.learner.evaluation import HeldOut
from asyncfp8.learner.publisher import FIRST_CALIBRATION_PROMPTS
from asyncfp8.models import load_model
from asyncfp8.precision import PrecisionPolicy
from asyncfp8.precision.sensitivity import LayoutDrift, mixed_part
from asyncfp8.refit.reference import ReferenceForward
from asyncfp8.run import distributed, failpoints
from asyncfp8.train.guard import GuardSettings
from asyncfp8.train.logprobs import install_logprob_head
from asyncfp8.train.loss_scale import LossScaler, LossScaleSettings
from asyncfp8.train.phases import PhaseClock
from asyncfp8.train.proximal_thread import ProximalThread
from asyncfp8.train.rollback import HeldOutGuard, StepGuard
from asyncfp8.train.step import TrainStep, lr_lambda
from asyncfp8.train.versions import VersionWeights, available_memory, choose_proximal

log = logging.getLogger("asyncfp8.learner")


def sharded_model(
    policy: PrecisionPolicy,
    model_dir: Path,
    ranks: distributed.Ranks,
    dtype: torch.dtype,
    activation_checkpointing: bool,
    frozen: bool = False,
) -> torch.nn.Module:
    """The model from `model_dir` as the learner computes with it (the policy's learner
    forward, the log-prob head), sharded over the ranks; `frozen`: a reference, no grads."""
    model = policy.prepare_learner(load_model(model_dir, dtype=torch.float32))
    install_logprob_head(model)
    if frozen:
        model.requires_grad_(False)
    return distributed.shard(
        model,
        ranks.device,
        dtype,
        frozen=frozen,
        activation_checkpointing=activation_checkpointing and not frozen,
    )


def optimizer_and_schedule(
    model: torch.nn.Module, optim: DictConfig, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its learning-rate schedule (`optim.schedule`); the poison fail point
    installed on it where the reliability suite arms it."""
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    failpoints.install_poison(optimizer)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, steps))


def proximal_weights(
    cfg: DictConfig, model: torch.nn.Module, max_staleness: int, policy: PrecisionPolicy
) -> tuple[str, VersionWeights | None]:
    """Which π_prox the run takes (`correction.proximal`; auto chooses) and, for each
    sample's own version, the copies of the versions stale samples can have."""
    keep = max_staleness + 1
    proximal, why = choose_proximal(
        str(cfg.correction.proximal),
        str(cfg.correction.mode),
        cfg.run.learner_procs,
        sum(p.numel() for p in model.parameters()),
        keep,
        available_memory(),
    )
    log.info("π_prox: %s (%s)", proximal, why)
    return proximal, VersionWeights(model, keep, policy) if proximal == "version" else None


def proximal_thread(
    cfg: DictConfig,
    policy: PrecisionPolicy,
    model_dir: Path,
    versions: VersionWeights | None,
    ranks: distributed.Ranks,
    dtype: torch.dtype,
    pad_token_id: int,
) -> ProximalThread | None:
    """correction.proximal_thread: stale tokens' π_prox scored as their groups arrive, on a
    model copy of its own (null: on a CPU learner, where it was measured to pay)."""
    asked = cfg.correction.get("proximal_thread")
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"correction.proximal_thread must be true, false or null; got {asked!r}")
    on = asked if asked is not None else ranks.device.type == "cpu"
    if ranks.world > 1:  # each rank holds shards: the scorer would need the whole model
        on = False
    if on and policy.learner_forward != "master":
        if asked:
            raise ValueError(
                "correction.proximal_thread=true scores with the learner's plain forward; "
                f"precision.learner_forward={policy.learner_forward} needs the step's own "
                "(set correction.proximal_thread=false)"
            )
        on = False
    if cfg.correction.get("routing_replay"):  # its scorer routes on its own (checks.py)
        on = False
    if not on or versions is None:  # without kept versions there is nothing to score ahead
        return None
    scorer = policy.prepare_learner(load_model(model_dir, dtype=torch.float32))
    install_logprob_head(scorer)
    scorer = scorer.to(device=ranks.device, dtype=dtype)
    log.info("π_prox of stale tokens: scored ahead on a thread of its own")
    return ProximalThread(
        scorer, versions, cfg.run.temperature, cfg.optim.logprob_chunk_tokens, pad_token_id
    )


def train_step(
    cfg: DictConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    correction: Correction,
    pad_token_id: int,
    ranks: distributed.Ranks,
    dtype: torch.dtype,
    reference: torch.nn.Module | None,
    proximal: str,
    versions: VersionWeights | None,
    scored_ahead: ProximalThread | None = None,
) -> TrainStep:
    """The training step with its optional parts: the guard, the FP16 loss scale, and the
    bounds calibrated on the first step."""
    guard = None
    if cfg.guard.enabled:
        guard = StepGuard(GuardSettings.from_config(cfg.guard), model, optimizer)
    loss_scaler = None
    if dtype == torch.float16:  # FP16 gradients need their loss scaled; BF16's range is FP32's
        loss_scaler = LossScaler(LossScaleSettings.from_config(cfg.optim.loss_scale))
    return TrainStep(
        model,
        optimizer,
        scheduler,
        correction,
        cfg.optim,
        cfg.correction.mode,
        cfg.run.temperature,
        pad_token_id,
        ranks.device,
        reference=reference,
        world=ranks.world,
        guard=guard,
        versions=versions,
        loss_scaler=loss_scaler,
        calibration=bound_calibration(cfg.correction, correction, proximal),
        min_kept=cfg.correction.min_kept,
        starved=str(cfg.correction.starved),
        proximal_thread=scored_ahead,
        routing_replay=bool(cfg.correction.get("routing_replay", False)),
        clock=PhaseClock(cfg.run.phase_times, ranks.device),
    )


def bound_calibration(
    settings: DictConfig, correction: Correction, proximal: str
) -> BoundCalibration | None:
    """correction.target_rejected: the correction's unset bounds set on the first step
    (asyncfp8/correction/calibration.py); a resume keeps them (checkpointed)."""
    target = settings.target_rejected
    if target is None:
        return None
    if proximal == "current" and settings.mode == "decoupled":
        log.warning(
            "correction.target_rejected calibrates %s's bounds on the precision's mismatch "
            "alone, but with correction.proximal=current the ratio it bounds also holds the "
            "staleness: it will reject more than %.3g (docs/correction.md); "
            "correction.proximal=version is what these bounds are for",
            settings.name,
            target,
        )
    return BoundCalibration(correction, target)


def heldout(cfg: DictConfig, task, tokenizer, ranks, dtype, kv_scales) -> HeldOut | None:
    """Held-out evaluation every `eval.every` steps (None: 0, off)."""
    if not cfg.eval.every:
        return None
    run = cfg.run
    return HeldOut(
        task,
        tokenizer,
        cfg.eval.prompts,
        cfg.eval.samples,
        run.max_new_tokens,
        run.temperature,
        run.seed,
        ranks,
        dtype,
        kv_scales,
    )


def heldout_guard(
    guard: DictConfig, evaluated: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> HeldOutGuard | None:
    """guard.heldout_below: an evaluation far below the run's best puts earlier weights back
    (None: the guard off, no evaluation, or the setting 0)."""
    if not evaluated or not guard.enabled:
        return None
    below = GuardSettings.from_config(guard).heldout_below
    return HeldOutGuard(below, model, optimizer) if below else None


def layout_drift(
    policy: PrecisionPolicy, model_dir: Path, task, tokenizer, ranks: distributed.Ranks
) -> LayoutDrift | None:
    """precision=mixed: the watch over its frozen layout, on rank 0 (a plain FP32 copy of
    the model on its device, loaded with each measured version's gathered weights)."""
    mixed = mixed_part(policy)
    if mixed is None or not mixed.remeasure_every or not ranks.main:
        return None
    model = load_model(model_dir, dtype=torch.float32)
    return LayoutDrift(mixed, model, task, tokenizer, ranks.device)


def first_calibration_batch(task, tokenizer, device: torch.device) -> dict[str, torch.Tensor]:
    """Calibration data before the first step: the task's first prompts."""
    texts = [task.prompt(i).text for i in range(FIRST_CALIBRATION_PROMPTS)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    return {key: value.to(device) for key, value in batch.items()}


def probe_reference(
    cfg: DictConfig, model_dir: Path, policy: PrecisionPolicy, ranks, colocated: bool
) -> ReferenceForward | None:
    """The refit probe's reference (asyncfp8/refit/probe.py), on rank 0 (colocated, on every
    rank, each checking its own engine): what an engine running each version must compute
    on a few sequences, shipped with the version."""
    if not cfg.sync.probe.enabled or not (ranks.main or colocated):
        return None
    return ReferenceForward(model_dir, policy)


def colocated_engine(
    cfg: DictConfig, model_dir: Path, task, policy: PrecisionPolicy, ranks: distributed.Ranks
) -> Colocated:
    """With run.placement=colocated, this rank's own rollout engine, on its device (under
    torchrun each rank has one; overlapped, their rollout threads talk over a group of their
    own)."""
    settings: dict[str, Any] = dict(cfg.engine)
    device = str(settings.get("device", "auto"))  # the vllm and sglang engines have none
    if ranks.world > 1 and device.startswith("cuda:"):
        raise ValueError(
            f"engine.device={device} would put all {ranks.world} colocated ranks' "
            "engines on one GPU; with engine.device=auto each rank's runs on its own"
        )
    run = cfg.run
    if settings["name"] == "torch":
        if device in ("auto", "cuda") and torch.cuda.is_available():
            settings["device"] = f"cuda:{ranks.local_rank}"  # this rank's GPU
        on_gpu = str(settings["device"]).startswith("cuda")
    else:  # vllm, on the GPU when its build has one
        on_gpu = torch.cuda.is_available()
        if settings.get("gpu_memory_utilization") is None and on_gpu:
            settings["gpu_memory_utilization"] = COLOCATED_VLLM_MEMORY
    release = release_engine_memory(run, on_gpu)
    if release and settings["name"] == "vllm":
        settings["sleep_mode"] = True
    with kept_random_state():
        engine = build_engine(settings, str(model_dir), policy)
    group = distributed.new_group(run.dist_timeout) if run.mode == "async" else None
    return Colocated(
        cfg, engine, task, policy, ranks.rank, ranks.world, group, release_memory=release
    )
