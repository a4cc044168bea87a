"""The warm-start: the supervised pass that gives RL a tiny policy with room to improve,
stopped once its temperature-1 sampled reward is inside a window, and the measure of the
saved model (why and how: docs/running.md, "Tiny models"). `tiny.py` holds each task's
recipe and builds, caches and ships the models."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from asyncfp8.tasks import Prompt, Task, get_task

from .sampling import mean_reward

REWARD_WINDOW = (0.05, 0.7)
# The task a model is warm-started on when the run's task has no reference completions.
DEFAULT_TASK: dict[str, Any] = {"name": "arithmetic"}


@dataclass(frozen=True)
class WarmStart:
    """The supervised pass that gives RL a policy with room to improve. `task`: the
    task's name and parameters (its seed and reward aside), e.g. {"name": "addition",
    "digits": 3}."""

    task: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_TASK))
    learning_rate: float = 3e-3
    batch_size: int = 64
    steps_per_check: int = 25
    max_steps: int = 4000
    stop_at_reward: float = 0.3
    overshoot_reward: float = 0.6
    check_prompts: int = 256
    final_prompts: int = 512
    # Steps trained before the reward may stop the warm-start.
    min_steps: int = 0
    # `addition` only: the supervised answers come from a teacher that forgets each carry
    # with this probability, so the model learns to carry only sometimes (what RL fixes).
    carry_drop: float = 0.0

    def __post_init__(self):
        if not 0 <= self.carry_drop < 1:
            raise ValueError(f"warm-start: carry_drop must be in [0, 1), got {self.carry_drop}")
        if self.carry_drop and self.task.get("name") != "addition":
            raise ValueError(
                f"warm-start: carry_drop is for the addition task, not {self.task.get('name')!r}"
            )
        if not 0 < self.stop_at_reward < self.overshoot_reward <= 1:
            raise ValueError(
                f"warm-start: need 0 < stop_at_reward < overshoot_reward <= 1, got "
                f"{self.stop_at_reward} and {self.overshoot_reward}"
            )
        low, high = REWARD_WINDOW
        if not low <= self.stop_at_reward <= high:
            raise ValueError(
                f"warm-start: stop_at_reward {self.stop_at_reward} is outside the window "
                f"[{low}, {high}] a warm-started model must score in"
            )


def describe(task: dict[str, Any]) -> str:
    """`addition (digits=3, answer_format=worked)`: a warm-start task, for messages."""
    params = ", ".join(f"{k}={v}" for k, v in task.items() if k != "name")
    return f"{task['name']} ({params})" if params else task["name"]


def supervised_batch(
    tokenizer, task: Task, prompts: list[Prompt], completion=None
) -> dict[str, torch.Tensor]:
    """Prompt + completion (`completion(prompt)`, default the task's reference) + eos,
    right-padded; loss only on the completion."""
    completion = completion or task.completion
    rows, labels = [], []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt.text)["input_ids"]
        target_ids = tokenizer(completion(prompt))["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + target_ids)
        labels.append([-100] * len(prompt_ids) + target_ids)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def answer_tokens(tokenizer, task: Task) -> int:
    """Tokens to sample when scoring: the longest of a few reference answers, and room
    for a model that runs on past it."""
    longest = max(len(tokenizer(task.completion(task.prompt(i)))["input_ids"]) for i in range(64))
    return longest + 4


def warm_start(model, tokenizer, recipe: WarmStart, seed: int, progress: bool = True) -> dict:
    """Train until the sampled reward reaches `stop_at_reward`; a chunk of steps that
    overshoots `overshoot_reward` is undone and retried at half the learning rate. The
    training and check prompts come from the task's prompt stream (other seeds), which
    never holds a held-out prompt."""
    train_task = get_task(**recipe.task, seed=seed)
    check_task = get_task(**recipe.task, seed=seed + 10_000)
    check_prompts = [check_task.prompt(i) for i in range(recipe.check_prompts)]
    max_new_tokens = answer_tokens(tokenizer, train_task)
    teacher = None
    if recipe.carry_drop:

        def teacher(prompt):
            return train_task.sloppy_completion(prompt, recipe.carry_drop, seed)

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    step, reward, history = 0, 0.0, []
    bar = tqdm(
        total=recipe.max_steps, desc="warm-start", disable=None if progress else True, leave=False
    )
    model.train()
    while reward < recipe.stop_at_reward or step < recipe.min_steps:
        if step >= recipe.max_steps:
            bar.close()
            raise RuntimeError(
                f"warm-start on {describe(recipe.task)} reached reward {reward:.3f} < "
                f"stop_at_reward {recipe.stop_at_reward} after {step} steps; raise max_steps "
                "or learning_rate (RECIPES in asyncfp8/models/tiny.py), or pick a bigger model"
            )
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), step)
        # An MoE adds transformers' load-balancing loss (its router_aux_loss_coef, 0.001) so
        # that no expert starves.
        moe = {"output_router_logits": True} if getattr(model.config, "num_experts", 0) else {}
        for _ in range(recipe.steps_per_check):
            start = step * recipe.batch_size
            batch = supervised_batch(
                tokenizer,
                train_task,
                [train_task.prompt(start + i) for i in range(recipe.batch_size)],
                teacher,
            )
            loss = model(**batch, **moe).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            bar.update(1)
        reward = mean_reward(model, tokenizer, check_task, check_prompts, max_new_tokens, seed=seed)
        history.append({"step": step, "loss": round(loss.item(), 4), "reward": reward})
        bar.set_postfix(loss=f"{loss.item():.3f}", reward=f"{reward:.3f}")
        if progress and bar.disable:  # no terminal (a log file): a line per check instead
            print(
                f"[warm-start] {describe(recipe.task)}: step {step}, loss {loss.item():.3f}, "
                f"reward at T=1 {reward:.3f} (stops at {recipe.stop_at_reward})",
                flush=True,
            )
        if reward > recipe.overshoot_reward:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            step = saved[2]
            for group in optimizer.param_groups:
                group["lr"] /= 2
            reward = 0.0
    bar.close()
    return {"steps": step, "history": history}


def measure_saved_model(model_dir: Path, recipe: WarmStart, seed: int) -> float:
    """Mean temperature-1 reward of the saved (BF16) model on prompts it was not tuned on."""
    from asyncfp8.hf.loading import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir, dtype=torch.bfloat16), load_tokenizer(model_dir)
    task = get_task(**recipe.task, seed=seed + 20_000)
    prompts = [task.prompt(i) for i in range(recipe.final_prompts)]
    return mean_reward(
        model, tokenizer, task, prompts, answer_tokens(tokenizer, task), seed=seed + 1
    )
