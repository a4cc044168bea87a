"""Held-out evaluation: pass@1 of the learner's current policy on prompts it never
trains on, greedy (temperature 0) and at the run's sampling temperature.

The prompts are the task's held-out split (`Task.heldout_prompts`: disjoint from the
prompt stream and from what the tiny models were warm-started on), fixed for the run.
The learner evaluates between steps, with its own weights (the workers keep generating
meanwhile): every rank generates for its share of the prompts with the sharded model,
in lock-step (`synced_gpus`: a rank whose sequences have all ended keeps joining the
others' forwards), and the scores are summed over ranks. pass@1 is the mean reward
(for a 0/1 reward, the fraction of prompts solved); sampled pass@1 averages
`eval.samples` samples per prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from asyncfp8 import distributed
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
    ):
        if prompts < 1 or samples < 1:
            raise ValueError(
                f"eval.prompts and eval.samples must be >= 1, got {prompts}, {samples}"
            )
        self.task, self.tokenizer, self.ranks = task, tokenizer, ranks
        self.prompts = task.heldout_prompts(prompts)
        self.samples, self.max_new_tokens = samples, max_new_tokens
        self.temperature, self.seed = temperature, seed

    def _generate(self, model, prompts: list[Prompt], sample: bool) -> list[str]:
        config = GenerationConfig(
            do_sample=sample,
            temperature=self.temperature if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            num_return_sequences=self.samples if sample else 1,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        batch = self.tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
        batch = {key: value.to(self.ranks.device) for key, value in batch.items()}
        output = model.generate(**batch, generation_config=config, synced_gpus=True)
        return self.tokenizer.batch_decode(
            output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )

    def _scores(self, model, prompts: list[Prompt], sample: bool) -> list[float]:
        completions = self._generate(model, prompts, sample)
        repeat = self.samples if sample else 1
        return [
            self.task.score(completion, prompts[i // repeat])
            for i, completion in enumerate(completions)
        ]

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, Any]:
        """Collective: every rank calls it. Leaves the RNG state and the model's train /
        eval mode as they were."""
        mine = self.prompts[self.ranks.rank :: self.ranks.world]
        # A rank without a prompt of its own still runs the forwards (they are collective)
        # on a stand-in whose scores do not count.
        counted = bool(mine)
        mine = mine or self.prompts[:1]
        cpu_state = torch.random.get_rng_state()
        cuda_state = torch.cuda.get_rng_state() if self.ranks.device.type == "cuda" else None
        torch.manual_seed(self.seed * 1_000_003 + self.ranks.rank)
        was_training = model.training
        model.eval()
        try:
            greedy = self._scores(model, mine, sample=False)
            sampled = self._scores(model, mine, sample=self.temperature > 0)
        finally:
            model.train(was_training)
            torch.random.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state)
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
