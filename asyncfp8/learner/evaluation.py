"""Held-out evaluation: pass@1 of the learner's policy, greedy and at the run's temperature,
on the task's held-out prompts (never trained on). It samples as the built-in engine does,
one seeded stream per prompt, so the scores depend on neither the ranks nor the global RNG;
every rank takes a share of the prompts in lock-step and the scores are summed over ranks.
pass@1 is the mean reward; sampled pass@1 averages `eval.samples` samples a prompt."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.model_sampling import sample_from_model
from asyncfp8.run import distributed
from asyncfp8.tasks import Prompt, Task


class HeldOut:
    def __init__(
        self,
        task: Task,
        tokenizer,
        prompts: int,
        samples: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        ranks: distributed.Ranks,
        dtype: torch.dtype | None = None,
        kv_scales: Callable[[], list[tuple[torch.Tensor, torch.Tensor]] | None] | None = None,
    ):
        """`kv_scales`: called at each evaluation, the per-layer (k, v) scales of an e4m3
        KV cache when the learner's own forward rounds keys and values to e4m3 (an FP8 KV
        cache with precision.learner_forward=quantized), else None."""
        if prompts < 1 or samples < 1:
            raise ValueError(
                f"eval.prompts and eval.samples must be >= 1, got {prompts}, {samples}"
            )
        self.task, self.tokenizer, self.ranks, self.dtype = task, tokenizer, ranks, dtype
        self.kv_scales = kv_scales
        self.prompts = task.heldout_prompts(prompts)
        self.greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        self.sampled = None  # at temperature 0 the sampled pass@1 is the greedy one
        if temperature > 0:
            self.sampled = SamplingParams(
                n=samples, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed
            )

    def _scores(
        self,
        model,
        prompts: Sequence[Prompt],
        indices: Sequence[int],
        sampling: SamplingParams,
        all_done: Callable[[bool], bool] | None,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> list[float]:
        """The reward of each completion, prompt-major (`sampling.n` per prompt)."""
        generated = sample_from_model(
            model,
            [self.tokenizer(p.text)["input_ids"] for p in prompts],
            sampling,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            indices=indices,
            dtype=self.dtype,
            all_done=all_done,
            kv_scales=kv_scales,
        )
        texts = self.tokenizer.batch_decode(
            [g.token_ids for g in generated], skip_special_tokens=True
        )
        return [self.task.score(text, prompts[i // sampling.n]) for i, text in enumerate(texts)]

    def evaluate(self, model) -> dict[str, Any]:
        """Collective: every rank calls it. Leaves the model's train / eval mode and
        attention implementation as they were, and draws nothing from torch's RNG."""
        world, rank = self.ranks.world, self.ranks.rank
        indices = list(range(rank, len(self.prompts), world))
        # A rank without a prompt of its own still runs the forwards (they are collective)
        # on a stand-in whose scores do not count.
        counted = bool(indices)
        indices = indices or [0]
        mine = [self.prompts[i] for i in indices]
        all_done = None if world == 1 else all_ranks_done
        kv_scales = None if self.kv_scales is None else self.kv_scales()
        greedy = self._scores(model, mine, indices, self.greedy, all_done, kv_scales)
        sampled = greedy
        if self.sampled is not None:
            sampled = self._scores(model, mine, indices, self.sampled, all_done, kv_scales)
        weight = 1.0 if counted else 0.0
        sums = distributed.sum_over_ranks(
            {
                "greedy": weight * sum(greedy),
                "sampled": weight * sum(sampled),
                "prompts": weight * len(greedy),
                "samples": weight * len(sampled),
            }
        )
        return {
            "eval/pass1_greedy": sums["greedy"] / sums["prompts"],
            "eval/pass1_sampled": sums["sampled"] / sums["samples"],
            "eval/prompts": int(sums["prompts"]),
        }


def all_ranks_done(done_here: bool) -> bool:
    """Whether every rank's sequences are done (collective: once per decode step)."""
    return distributed.sum_over_ranks({"undone": float(not done_here)})["undone"] == 0
