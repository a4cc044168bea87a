"""TRL's `GRPOTrainer` on an asyncfp8 job: run by `bench/peers.py` inside TRL's own
environment (TRL, transformers and accelerate as TRL pins them, torch the local build),
never imported by asyncfp8.

    .cache/peers/trl-1.16.0/bin/python bench/peers_trl.py --job job.json --out DIR

`job.json` (written by bench/peers.py) names the model directory, the prompts in
stream order with their answers, the reward (`_target_` and its arguments, imported
from this checkout: asyncfp8's reward functions are plain Python) and the
hyperparameters, mapped onto GRPOConfig so that TRL trains what asyncfp8 trains:

asyncfp8 → GRPOConfig:

- run.groups_per_step × run.group_size samples per step → per_device_train_batch_size,
  num_generations
- one optimizer step per batch (optim.mini_batches 1, ppo_epochs 1) →
  steps_per_generation 1, num_iterations 1
- optim.loss ppo_clip, clip_low / clip_high → epsilon / epsilon_high
- optim.aggregation token_mean → loss_type "dapo" (tokens of the whole batch)
- optim.advantage_scale std → scale_rewards "group"
- optim.kl_coef 0 → beta 0 (no reference model)
- AdamW(lr, betas, eps, weight_decay), optim.warmup_steps, grad_clip → the same,
  warmup_steps, max_grad_norm
- optim.schedule constant / cosine (to 0.1 × lr at the last step) → lr_scheduler_type
  constant_with_warmup / cosine_with_min_lr (min_lr_rate 0.1)
- the prompt stream in order → shuffle_dataset false
- run.temperature, run.max_new_tokens → temperature, top_p 1, max_completion_length
- FP32 on the CPU → use_cpu, bf16 false

With `save_every` in the job, the model is also saved every that many steps
(`DIR/trainer/checkpoint-N/`, for bench/peers.py's held-out curve).

Writes `DIR/steps.jsonl` (per optimizer step: wall clock since the trainer started,
the seconds spent generating and scoring, the mean reward) and `DIR/model/` (the trained
weights in BF16, as asyncfp8 exports its masters, so both are evaluated from the same
rounding).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

# This script's folder holds bench/kernels.py, bench/sync.py, ...: left first on the path
# they would shadow the packages of those names that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for the reward function


def reward_function(spec: dict):
    """TRL's reward signature around asyncfp8's `reward(completion, answer) -> float`."""
    module, name = spec.pop("_target_").rsplit(".", 1)
    reward = functools.partial(getattr(importlib.import_module(module), name), **spec)

    def task_reward(prompts, completions, answer, **_):
        return [float(reward(c, a)) for c, a in zip(completions, answer, strict=True)]

    return task_reward


class TimedGRPOTrainer(GRPOTrainer):
    """Records the seconds each generation (sampling, reward, advantages) takes."""

    generation_seconds: float = 0.0

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        self.generation_seconds += time.perf_counter() - start
        return output


class StepLog(TrainerCallback):
    def __init__(self, path: Path, trainer_start: float):
        self.file = path.open("w")
        self.start = trainer_start
        self.trainer: TimedGRPOTrainer | None = None
        self.rewards: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards[state.global_step] = logs["reward"]

    def on_step_end(self, args, state, control, **kwargs):
        record = {
            "step": state.global_step,
            "elapsed_s": time.perf_counter() - self.start,
            "generation_s_total": self.trainer.generation_seconds,
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self, path: Path) -> None:
        self.file.close()
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for record in records:
            record["reward"] = self.rewards.get(record["step"])
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    torch.manual_seed(job["seed"])
    torch.set_num_threads(job["threads"])
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(job["model"], local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=torch.float32, local_files_only=True
    )
    dataset = Dataset.from_list(
        [{"prompt": p["text"], "answer": p["answer"]} for p in job["prompts"]]
    )
    optim = job["optim"]
    schedules = {
        "constant": ("constant_with_warmup", {}),
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    }
    if optim["schedule"] not in schedules:
        raise SystemExit(f"peers_trl: no GRPOConfig mapping for optim.schedule={optim['schedule']}")
    scheduler, scheduler_kwargs = schedules[optim["schedule"]]
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"),
        max_steps=job["steps"],
        per_device_train_batch_size=job["groups"] * job["group_size"],
        num_generations=job["group_size"],
        steps_per_generation=1,
        num_iterations=1,
        gradient_accumulation_steps=1,
        learning_rate=optim["lr"],
        adam_beta1=optim["betas"][0],
        adam_beta2=optim["betas"][1],
        adam_epsilon=optim["eps"],
        weight_decay=optim["weight_decay"],
        max_grad_norm=optim["grad_clip"],
        lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=scheduler_kwargs,
        warmup_steps=optim["warmup_steps"],
        epsilon=optim["clip_low"],
        epsilon_high=optim["clip_high"],
        loss_type="dapo",
        scale_rewards="group",
        beta=0.0,
        temperature=job["temperature"],
        top_p=1.0,
        max_completion_length=job["max_new_tokens"],
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        seed=job["seed"],
        logging_steps=1,
        report_to="none",
        # job["save_every"] > 0: the model alone every that many steps (bench/peers.py --curve)
        save_strategy="steps" if job.get("save_every") else "no",
        save_steps=job.get("save_every") or 500,
        save_only_model=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    start = time.perf_counter()
    log = StepLog(args.out / "steps.jsonl", start)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward_function(dict(job["reward"])),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[log],
    )
    log.trainer = trainer
    trainer.train()
    log.close(args.out / "steps.jsonl")
    trainer.model.to(torch.bfloat16).save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")
    print(f"trained {job['steps']} steps in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
