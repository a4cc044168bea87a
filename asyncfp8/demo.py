"""A tour of what asyncfp8 has today: a locally made, warm-started model, a task, and
temperature-1 samples scored by the task's reward.

    python -m asyncfp8.demo                     # the small model on arithmetic
    python -m asyncfp8.demo model=tiny task=gsm8k_jsonl samples=3
"""

from __future__ import annotations

import time

import hydra
import torch
from omegaconf import DictConfig

from asyncfp8.models import load_model, load_tokenizer, read_metadata, resolve_model_dir
from asyncfp8.models.sampling import mean_reward, sample_completions
from asyncfp8.tasks import build_task, registered_tasks


@hydra.main(version_base="1.3", config_path="conf", config_name="demo")
def main(cfg: DictConfig) -> None:
    started = time.perf_counter()
    print(
        f"[demo] model: {cfg.model.path or f'tiny factory, size={cfg.model.size} seed={cfg.model.seed}'}"
    )
    model_dir = resolve_model_dir(cfg.model.path, cfg.model.size, cfg.model.seed)
    model, tokenizer = load_model(model_dir, dtype=torch.bfloat16), load_tokenizer(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    meta = read_metadata(model_dir) or {}
    print(
        f"[demo] {model_dir}: {n_params / 1e6:.2f}M parameters"
        + (f", warm-started {meta['warm_start_steps']} steps" if meta else "")
    )

    task = build_task(cfg.task)
    print(f"[demo] task {task.name!r} (registered: {', '.join(registered_tasks())})")
    shown = [task.prompt(i) for i in range(cfg.samples)]
    completions = sample_completions(
        model,
        tokenizer,
        [p.text for p in shown],
        cfg.max_new_tokens,
        cfg.temperature,
        seed=cfg.seed,
    )
    for prompt, completion in zip(shown, completions, strict=True):
        question = prompt.text.replace("\n", " | ")
        if len(question) > 70:
            question = question[:67] + "..."
        print(
            f"  {question:<72} -> {completion.strip()!r:<10} answer {prompt.answer:>6}  "
            f"reward {task.score(completion, prompt):.0f}"
        )

    measured = [task.prompt(cfg.samples + i) for i in range(cfg.eval_prompts)]
    reward = mean_reward(
        model, tokenizer, task, measured, cfg.max_new_tokens, cfg.temperature, cfg.seed
    )
    print(
        f"[demo] mean reward at temperature {cfg.temperature} over {cfg.eval_prompts} prompts: "
        f"{reward:.3f}  ({time.perf_counter() - started:.1f} s)"
    )


if __name__ == "__main__":
    main()
