"""A fixed, recorded set of GRPO groups on the tiny model (no workers needed), and a
Learner built in-process from the real Hydra config: what the learner tests train on."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch

from asyncfp8.launch.processes import free_ports
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.sync import Trajectory
from asyncfp8.tasks import ArithmeticTask
from asyncfp8.train.batches import Group, batch_tensors
from asyncfp8.train.logprobs import completion_logprobs, install_logprob_head


def record_groups(
    model_dir: Path, steps: int, groups: int, group_size: int, seed: int = 0
) -> list[list[Group]]:
    """`steps` batches of `groups` groups: task prompts, random completions of 1-6 tokens,
    rollout log-probs = the tiny model's own plus noise (a mismatch for the correction to
    see), rewards 0/1 with at least one of each per group."""
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir).eval()
    install_logprob_head(model)
    task = ArithmeticTask()
    batches, prompt = [], 0
    for _ in range(steps):
        step = []
        for lease in range(groups):
            prompt_ids = tokenizer(task.prompt(prompt).text)["input_ids"]
            trajectories = []
            for i in range(group_size):
                tokens = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
                t = Trajectory(
                    prompt_ids, tokens, [0.0] * len(tokens), [0] * len(tokens), 0.0, f"{prompt}"
                )
                t.reward = float(i == 0 or rng.random() < 0.4) if i < group_size - 1 else 0.0
                t.prompt_index, t.finish_reason = prompt, "length"
                t.sender, t.seq = "recorded/0", prompt * group_size + i
                trajectories.append(t)
            step.append(Group(lease, prompt, trajectories))
            prompt += 1
        flat = [t for g in step for t in g.trajectories]
        batch = batch_tensors(flat, tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, batch, temperature=1.0)
        noise = 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
        for row, t in enumerate(flat):
            t.logprobs = (
                (logp[row, : len(t.token_ids)] + noise[row, : len(t.token_ids)])
                .clamp(max=0.0)
                .tolist()
            )
        batches.append(step)
    return batches


def save_groups(batches: list[list[Group]], path: Path) -> None:
    path.write_text(
        json.dumps(
            [
                [[g.lease, g.prompt, [dataclasses.asdict(t) for t in g.trajectories]] for g in step]
                for step in batches
            ]
        )
    )


def load_groups(path: Path) -> list[list[Group]]:
    return [
        [
            Group(lease, prompt, [Trajectory(**t) for t in members])
            for lease, prompt, members in step
        ]
        for step in json.loads(path.read_text())
    ]


def learner_config(model_dir: Path, run_dir: Path, *overrides: str):
    """The learner's Hydra config for the recorded groups (4 groups of 4 per step)."""
    from hydra import compose, initialize_config_module

    ports = free_ports(3)
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        return compose(
            "config",
            overrides=[
                f"model.path={model_dir}",
                "task=arithmetic",  # what the tiny test model was warm-started on
                "run.max_new_tokens=8",
                f"run.dir={run_dir}",
                f"sync.version_port={ports[0]}",
                f"sync.snapshot_port={ports[1]}",
                f"sync.trajectory_port={ports[2]}",
                "run.groups_per_step=4",
                "run.group_size=4",
                "run.device=cpu",
                f"run.threads={torch.get_num_threads()}",
                "run.tensorboard=false",
                "eval.every=0",
                "optim.warmup_steps=0",
                *overrides,
            ],
        )


def plain_train_step(model_dir: Path, *overrides: str):
    """(`TrainStep` over a plain FP32 model and the config's AdamW, the model, the config):
    built from the learner's config alone, with no learner, process group or ports."""
    from asyncfp8.correction import build_correction
    from asyncfp8.learner.build import optimizer_and_schedule
    from asyncfp8.train.step import TrainStep

    cfg = learner_config(model_dir, Path("unused"), *overrides)
    model = load_model(model_dir, dtype=torch.float32)
    install_logprob_head(model)
    optimizer, scheduler = optimizer_and_schedule(model, cfg.optim, cfg.run.steps)
    step = TrainStep(
        model,
        optimizer,
        scheduler,
        build_correction(cfg.correction),
        cfg.optim,
        cfg.correction.mode,
        cfg.run.temperature,
        load_tokenizer(model_dir).pad_token_id,
        torch.device("cpu"),
    )
    return step, model, cfg


def train(learner, groups: list[Group]) -> dict:
    """One step of `learner` on `groups` as its loop would run it (every rank calls it;
    the groups are used on rank 0 only)."""
    from asyncfp8.run import distributed

    main = learner.ranks.main
    share = distributed.scatter(learner.shares(groups) if main else None)
    return learner.train(share, groups if main else None)


def assert_same_updates(learner, reference, lr: float, steps: int) -> None:
    """`learner`'s weights after its first `steps` Adam steps are `reference`'s (an FP32
    CPU learner on the same data) within rounding, and its masters stay FP32. Adam moves
    a weight by about ±lr per step whatever its gradient's size, so where a gradient is
    within rounding of 0 its sign, and the weight's move, is a coin toss: under BF16 on
    an H100, 97 of q_proj's 4,096 weights landed more than lr/2 from the CPU's, and
    3 of 32 k_proj biases under FP16 (a key bias's gradient is 0 in exact arithmetic:
    softmax ignores a shift shared by all keys). So at most 5% of all the weights may
    differ by more than lr/2, and none by more than 2·lr·steps (every step flipped)."""
    from asyncfp8.run import distributed

    weights = distributed.full_state_dict(learner.model)
    flipped, total, largest, worst = 0, 0, 0.0, []
    for name, value in distributed.full_state_dict(reference.model).items():
        assert weights[name].dtype == torch.float32, name
        difference = (weights[name].cpu() - value.cpu()).abs()
        off = int((difference > lr / 2).sum())
        flipped, total = flipped + off, total + difference.numel()
        largest = max(largest, difference.max().item())
        worst.append((off / difference.numel(), name))
    worst = ", ".join(f"{name} {share:.1%}" for share, name in sorted(worst, reverse=True)[:3])
    summary = (
        f"{flipped} of {total} weights off by more than lr/2 (most: {worst}), "
        f"the largest by {largest:.2e}"
    )
    print(summary)
    assert flipped <= 0.05 * total and largest <= 2 * lr * steps * 1.01, summary
