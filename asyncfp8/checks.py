"""The whole config checked before any process binds a socket or loads a model (the launcher
first, then the learner and every worker at their start), so a bad setting is named within
seconds instead of surfacing as a crash in one log. What it builds on the way (the precision
policy, the correction, the task) is returned, so the caller does not build them twice."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from asyncfp8.correction import Correction, build_correction
from asyncfp8.engines import supports as engine_supports
from asyncfp8.engines.base import check_slots
from asyncfp8.engines.speculative.settings import SpeculativeSettings, check_drafter_checkpoint
from asyncfp8.moe.architectures import check_architecture, is_moe
from asyncfp8.precision import PrecisionPolicy, build_policy
from asyncfp8.report.metrics import loggers_of
from asyncfp8.run.process import check_counts
from asyncfp8.sync.endpoints import curve, endpoints
from asyncfp8.sync.transport import is_local
from asyncfp8.tasks import Task, build_task
from asyncfp8.train.batches import check_split
from asyncfp8.train.guard import GuardSettings
from asyncfp8.train.loss_scale import LossScaleSettings
from asyncfp8.train.phases import PhaseClock

COLOCATED_ENGINES = ("torch", "vllm")  # the engines that run in the learner's process
TENSORBOARD_INSTALL = 'pip install -c constraints.txt -e ".[tensorboard]"'


@dataclass
class Checked:
    policy: PrecisionPolicy
    correction: Correction
    task: Task


def max_staleness_of(run: Any) -> int:
    """The staleness bound the run trains under (0 in sync mode)."""
    if run.mode not in ("async", "sync"):
        raise ValueError(f"run.mode must be async or sync, got {run.mode!r}")
    if run.mode == "sync":
        return 0
    if run.max_staleness is None or run.max_staleness < 0:
        raise ValueError(f"run.max_staleness must be >= 0, got {run.max_staleness!r}")
    return int(run.max_staleness)


def placement_of(run: Any) -> str:
    """`run.placement` as a process runs it: separate for a run saved before the setting
    existed, and for `auto` in a learner or worker started by hand or under srun (they
    are separate processes; only the launcher on one machine resolves auto, with
    `auto_placement`, and hands its children the result)."""
    placement = str(run.placement)
    if placement not in ("auto", "separate", "colocated"):
        raise ValueError(f"run.placement must be auto, separate or colocated, got {placement!r}")
    return "separate" if placement == "auto" else placement


def colocated_blockers(cfg: DictConfig) -> list[tuple[str, str]]:
    """What `run.placement=colocated` (the learner's own engine, learner/colocated.py)
    cannot do yet, as (the setting in a few words, the refusal naming it): the launcher's
    `auto` runs such a run separate, an explicit colocated one is refused."""
    run = cfg.run
    speculative = (cfg.engine.get("speculative") or {}).get("mode")
    device = str(cfg.engine.get("device", "auto"))
    blockers = [
        (
            run.learner_procs > 1 and device.startswith("cuda:"),
            f"engine.device={device} with run.learner_procs={run.learner_procs}",
            f"engine.device={device} would put every colocated rank's engine on one GPU; "
            f"each rank's engine runs on its rank's device with engine.device=auto",
        ),
        (
            cfg.engine.name not in COLOCATED_ENGINES,
            f"engine={cfg.engine.name} runs in worker processes",
            f"run.placement=colocated runs engine=torch or engine=vllm in the learner's "
            f"process, got engine={cfg.engine.name}; use one of those or run.placement=separate",
        ),
        (
            cfg.engine.name == "vllm" and run.learner_procs > 1,
            f"engine=vllm with run.learner_procs={run.learner_procs}",
            f"engine=vllm with run.learner_procs={run.learner_procs}: vLLM in a learner "
            "rank's process would build its parallel groups on the learner ranks' own "
            "torch.distributed world (torchrun's); colocated ranks each run engine=torch, "
            "or one learner rank (run.learner_procs=1) runs vLLM, or run.placement=separate",
        ),
        (
            bool(run.inflight_updates),
            "run.inflight_updates=true",
            "run.inflight_updates=true applies versions during a generation, but colocated "
            "the learner applies each version between its turns: run.inflight_updates=false",
        ),
        (
            speculative not in (None, False, "none"),
            f"engine.speculative.mode={speculative}",
            f"engine.speculative.mode={speculative}: the online drafter's state is a worker's "
            "checkpoint, which a colocated run has no worker to keep; "
            "engine.speculative.mode=none, or run.placement=separate",
        ),
    ]
    return [(setting, refusal) for blocked, setting, refusal in blockers if blocked]


def auto_placement(cfg: DictConfig, gpus: int) -> tuple[str, str]:
    """What the launcher runs for `run.placement=auto` with `gpus` GPUs, and why: colocated on
    one device, where processes would share it (one copy of the model, as fast as separate
    processes: docs/results.md); separate where the run asks for what only processes do,
    for several learner ranks, and for run.mode=sync or vLLM without a GPU, which measured
    slower colocated."""
    run = cfg.run
    separate_because = [
        (gpus > 1, f"{gpus} GPUs: the learner and its workers on devices of their own"),
        (
            gpus == 0 and run.mode == "sync",
            "run.mode=sync on a CPU: colocated turns measured slower than separate processes",
        ),
        (
            gpus == 0 and cfg.engine.name == "vllm",
            "engine=vllm on a CPU: colocated measured slower than one vLLM worker process "
            "(156 against 173 trained samples/s, one run each)",
        ),
        (run.workers is not None, f"run.workers={run.workers} asks for worker processes"),
        (
            run.learner_procs > 1,
            f"run.learner_procs={run.learner_procs}: colocated ranks are not measured faster "
            "than separate processes",
        ),
        *((True, setting) for setting, _ in colocated_blockers(cfg)),
    ]
    for separate, why in separate_because:
        if separate:
            return "separate", why
    device = "one GPU" if gpus == 1 else "the CPU, no GPU"
    return "colocated", f"one device ({device}): the learner generates with its own engine"


def check_placement(cfg: DictConfig, role: str) -> None:
    """What `run.placement=colocated` cannot do yet (`colocated_blockers`), refused by
    name."""
    if placement_of(cfg.run) != "colocated":
        return
    if role == "worker":
        raise ValueError(
            "run.placement=colocated: the learner generates with its own engine, so no "
            "worker process is started; run.placement=separate runs workers"
        )
    blockers = colocated_blockers(cfg)
    if blockers:
        raise ValueError(blockers[0][1])


def release_engine_memory(run: Any, on_gpu: bool, placement: str | None = None) -> bool:
    """`run.release_engine_memory` resolved for a run in `placement` (default: the run's):
    colocated in turns, the engine frees its KV cache while the learner trains. auto: only
    on a GPU, where the learner reuses the memory (a CPU has no device memory to share).
    True where no memory is ever idle is refused, naming why."""
    setting = run.release_engine_memory
    if setting not in ("auto", True, False):
        raise ValueError(f"run.release_engine_memory must be auto, true or false, got {setting!r}")
    placement = placement or placement_of(run)
    if setting == "auto":
        return placement == "colocated" and run.mode == "sync" and on_gpu
    if setting is False:
        return False
    if placement != "colocated":
        raise ValueError(
            "run.release_engine_memory=true frees the engine's memory while the learner "
            "trains in the same process: it needs run.placement=colocated (separate, each "
            "worker's engine has a process, and its memory, to itself)"
        )
    if run.mode != "sync":
        raise ValueError(
            "run.release_engine_memory=true: with run.mode=async the colocated engine "
            "generates while the learner trains, so its memory is never idle; run.mode=sync "
            "(turns) or run.release_engine_memory=false"
        )
    return True


def check_training(cfg: DictConfig) -> None:
    """The train step's and evaluation's settings."""
    optim = cfg.optim
    positive = {
        "optim.mini_batches": optim.mini_batches,
        "optim.ppo_epochs": optim.ppo_epochs,
        "optim.logprob_chunk_tokens": optim.logprob_chunk_tokens,
        "run.learner_procs": cfg.run.learner_procs,
        "eval.prompts": cfg.eval.prompts,
        "eval.samples": cfg.eval.samples,
    }
    if optim.micro_batch_tokens is not None:
        positive["optim.micro_batch_tokens"] = optim.micro_batch_tokens
    for key, value in positive.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if not isinstance(cfg.eval.every, int) or cfg.eval.every < 0:
        raise ValueError(f"eval.every must be an integer >= 0 (0: off), got {cfg.eval.every!r}")
    for key in ("kl_coef", "entropy_coef", "router_aux_coef"):
        if not optim[key] >= 0:
            raise ValueError(f"optim.{key} must be >= 0, got {optim[key]!r}")
    if optim.clip_ratio_c is not None and not optim.clip_ratio_c > 1:
        raise ValueError(f"optim.clip_ratio_c must be > 1 or null (off), got {optim.clip_ratio_c}")
    LossScaleSettings.from_config(optim.loss_scale)
    if cfg.correction.proximal == "version":
        if cfg.correction.mode == "bypass":
            raise ValueError(
                "correction.proximal=version needs correction.mode=decoupled (bypass has no "
                "π_prox: it is the rollout's own log-probs)"
            )
        if cfg.run.learner_procs > 1:
            raise ValueError(
                "correction.proximal=version runs on one learner rank only (each rank would "
                f"swap in other versions for other tokens), got run.learner_procs="
                f"{cfg.run.learner_procs}"
            )


def check_inflight_updates(cfg: DictConfig) -> None:
    """`engine.slots` (torch) is null or an int >= 1. `run.inflight_updates` needs an
    engine that can apply a version between two decode steps: the torch engine's slot
    loop. vLLM and SGLang apply versions between generate
    calls (their update waits for running requests), so they are refused here, by name."""
    slots = cfg.engine.get("slots")
    if cfg.engine.name == "torch":
        check_slots(slots)
    wanted = cfg.run.inflight_updates
    if wanted not in (True, False):
        raise ValueError(f"run.inflight_updates must be true or false, got {wanted!r}")
    if not wanted:
        return
    if cfg.engine.name != "torch":
        raise ValueError(
            f"run.inflight_updates=true needs an engine that applies versions between decode "
            f"steps; engine {cfg.engine.name} applies them between generate calls. Use "
            "engine=torch with engine.slots=N, or run.inflight_updates=false"
        )
    if slots is None:
        raise ValueError(
            "run.inflight_updates=true needs the torch engine's slots (the loop that applies "
            "versions between decode steps): set engine.slots=N, e.g. engine.slots=8"
        )


def check_speculative(cfg: DictConfig, model_dir: str | Path) -> None:
    """`engine.speculative`: a mode the engine can run (the torch engine's slots), a
    threshold >= 1, and a starting drafter checkpoint trained for this model."""
    node = cfg.engine.get("speculative")
    settings = SpeculativeSettings.from_config(
        None if node is None else OmegaConf.to_container(node),
        cfg.engine.name,
        cfg.engine.get("slots"),
    )
    if settings.enabled and settings.init is not None:
        from transformers import AutoConfig

        check_drafter_checkpoint(settings.init, AutoConfig.from_pretrained(str(model_dir)))


def check_moe(cfg: DictConfig, model_dir: str | Path, policy: PrecisionPolicy) -> None:
    """An MoE model is one the library runs (asyncfp8/moe/architectures.py), in a precision
    that covers its experts; `optim.router_aux_coef` asks for an MoE."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    replay = bool(cfg.correction.get("routing_replay", False))
    if not is_moe(config):
        for key, asked in (
            ("optim.router_aux_coef", cfg.optim.router_aux_coef > 0),
            ("correction.routing_replay", replay),
        ):
            if asked:
                raise ValueError(
                    f"{key} is for an MoE's routers, but {model_dir} is a dense model (no "
                    "routed experts): leave it off"
                )
        return
    check_architecture(config, f"model {model_dir}")
    if replay:
        check_routing_replay(cfg, model_dir)
    if policy.quantizes_weights and cfg.engine.name != "torch":
        raise ValueError(
            f"precision {policy.name!r} with engine={cfg.engine.name}: 8-bit experts run in "
            "the built-in torch engine only for now (vLLM's CPU wheel has no INT8 MoE "
            "kernel, runs blockwise FP8 only with AMX, and its GPU refit of 8-bit experts "
            "is untested); use engine=torch, or precision=bf16, fp16 or fp8_kv"
        )


def check_routing_replay(cfg: DictConfig, model_dir: str | Path) -> None:
    """correction.routing_replay needs an engine that returns the routes it ran: the torch
    engine in plain steps, eager, compiled or captured (asyncfp8/engines/slot_routes.py)."""
    engine = cfg.engine
    where = f"correction.routing_replay=true with model {model_dir} and engine={engine.name}"
    if engine.name != "torch":
        raise ValueError(
            f"{where}: engine {engine.name} returns no routes here (vLLM's route capture "
            "needs its V2 model runner on a GPU, not wired yet); use engine=torch"
        )
    if str(engine.speculative.mode) != "none":
        raise ValueError(
            f"{where}: the torch engine records no routes for the tokens a speculative step "
            "keeps; set engine.speculative.mode=none"
        )
    if cfg.correction.get("proximal_thread"):
        raise ValueError(
            f"{where}: correction.proximal_thread=true scores π_prox without the engine's "
            "routes; set it to false (or null)"
        )


def check_config(cfg: DictConfig, model_dir: str | Path, role: str) -> Checked:
    """ValueError naming the setting (and what to do) for the first problem found;
    `role` is "launcher", "learner" or "worker"."""
    run = cfg.run
    check_counts(cfg)
    max_staleness_of(run)
    if run.group_size < 2:
        raise ValueError(
            f"run.group_size must be >= 2 (GRPO compares samples of a prompt), got {run.group_size}"
        )
    check_training(cfg)
    GuardSettings.from_config(cfg.guard)
    if role == "launcher":  # the learner checks its split at the world size it started with
        check_split(run.groups_per_step * run.group_size, cfg.optim.mini_batches, run.learner_procs)
    check_placement(cfg, role)
    colocated = placement_of(run) == "colocated"
    # The launcher checks an auto placement as the colocated one it may become; the learner
    # checks the placement the launcher resolved.
    undecided = role == "launcher" and run.placement == "auto"
    release_engine_memory(run, on_gpu=False, placement="colocated" if undecided else None)
    if (
        role == "launcher"
        and not colocated
        and run.workers is not None
        and (not isinstance(run.workers, int) or run.workers < 1)
    ):
        raise ValueError(
            f"run.workers must be >= 1 for the launcher (it starts them) or null (one per "
            f"core the learner leaves, 1 or 2), got {run.workers!r}"
        )
    if run.tensorboard not in (True, False, "auto"):
        raise ValueError(f"run.tensorboard must be true, false or auto, got {run.tensorboard!r}")
    if run.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            f"run.tensorboard=true but TensorBoard is not installed: {TENSORBOARD_INSTALL} "
            "(or run.tensorboard=auto: use it when it is there)"
        )
    loggers_of(run)  # run.loggers: a tracker that is not installed, named at start
    PhaseClock(run.phase_times, torch.device("cpu"))  # run.phase_times in range
    check_inflight_updates(cfg)
    check_speculative(cfg, model_dir)
    addresses = endpoints(cfg.sync, "bind" if role == "learner" else "connect")
    if role == "worker" and cfg.sync.transport == "shm" and not is_local(addresses.versions):
        raise ValueError(
            f"sync.transport=shm, but the learner (sync.host={cfg.sync.host}) is not on this "
            "host: shared memory cannot reach another host. Use sync.transport=auto (shared "
            "memory where the learner is local, ZeroMQ elsewhere) or tcp"
        )
    curve(cfg.sync)
    policy = build_policy(cfg.precision, model_dir)
    check_moe(cfg, model_dir, policy)
    reason = engine_supports(cfg.engine.name, policy)
    if reason:
        raise ValueError(f"engine {cfg.engine.name} cannot run precision {policy.name!r}: {reason}")
    return Checked(policy, build_correction(cfg.correction), build_task(cfg.task, model_dir))
