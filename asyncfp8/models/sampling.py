"""Plain temperature-1 sampling with transformers, and the task reward it scores.

Used to measure a policy (the tiny-model warm-start, the demo); the rollout engines
in `asyncfp8.engines` are what RL samples with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from asyncfp8.tasks import Prompt, Task


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 256,
) -> list[str]:
    """One completion per prompt, sampled from the full distribution at `temperature`
    (no top-k / top-p), reproducible for a seed."""
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    completions: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(
                list(prompts[start : start + batch_size]), return_tensors="pt", padding=True
            )
            output = model.generate(**batch, generation_config=config)
            new_tokens = output[:, batch["input_ids"].shape[1] :]
            completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        torch.random.set_rng_state(generator_state)
    return completions


def mean_reward(
    model,
    tokenizer,
    task: Task,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    was_training = model.training
    model.eval()
    try:
        completions = sample_completions(
            model, tokenizer, [p.text for p in prompts], max_new_tokens, temperature, seed
        )
    finally:
        model.train(was_training)
    return sum(task.score(c, p) for c, p in zip(completions, prompts, strict=True)) / len(prompts)
