"""Plain temperature-1 sampling of a model outside an engine, and the task reward it scores.

Used to measure a policy (the tiny-model warm-start, the demo); it samples through the
built-in engine's decode loop and sampling rule (`engines.model_sampling`), so a seed
gives the tokens `TorchEngine` gives for the same weights."""

from __future__ import annotations

from collections.abc import Sequence

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.model_sampling import sample_from_model
from asyncfp8.tasks import Prompt, Task


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
    (no top-k / top-p), reproducible for a seed: prompt i's tokens depend on the seed
    and on i alone, not on `batch_size`."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        generated = sample_from_model(
            model,
            [tokenizer(text)["input_ids"] for text in batch],
            sampling,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            indices=range(start, start + len(batch)),
        )
        completions += tokenizer.batch_decode(
            [g.token_ids for g in generated], skip_special_tokens=True
        )
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
    completions = sample_completions(
        model, tokenizer, [p.text for p in prompts], max_new_tokens, temperature, seed
    )
    return sum(task.score(c, p) for c, p in zip(completions, prompts, strict=True)) / len(prompts)
