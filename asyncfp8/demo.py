"""A tour: a locally made, warm-started model, a task, a rollout engine running it at a chosen
precision, and the correction registry measuring the engine's mismatch with the learner.

    python -m asyncfp8.demo precision=fp8 correction=token_tis
"""

from __future__ import annotations

import time

import hydra
import torch
from omegaconf import DictConfig

import asyncfp8.conf  # noqa: F401  (stores the config schemas before Hydra composes)
from asyncfp8 import exit_on_version_flag
from asyncfp8.correction import build_correction
from asyncfp8.engines import SamplingParams, build_engine
from asyncfp8.models import load_model, load_tokenizer, read_metadata, run_model_dir
from asyncfp8.precision import build_policy, version_tensors
from asyncfp8.tasks import build_task, registered_tasks


def learner_logprobs(model, samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T] learner (FP32) and engine logprobs of the sampled tokens, and the mask."""
    width = max(len(s.token_ids) for s in samples)
    learner = torch.zeros(len(samples), width)
    rollout = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    with torch.no_grad():
        for row, sample in enumerate(samples):
            ids = torch.tensor([sample.prompt_ids + sample.token_ids])
            logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
            n = len(sample.token_ids)
            learner[row, :n] = torch.log_softmax(logits, -1).gather(
                -1, ids[0, len(sample.prompt_ids) :, None]
            )[:, 0]
            rollout[row, :n] = torch.tensor(sample.logprobs)
            mask[row, :n] = True
    return learner, rollout, mask


@hydra.main(version_base="1.3", config_path="conf", config_name="demo")
def main(cfg: DictConfig) -> None:
    started = time.perf_counter()
    model_dir = run_model_dir(cfg)
    learner = load_model(model_dir, dtype=torch.float32).eval()
    meta = read_metadata(model_dir) or {}
    parameters = sum(p.numel() for p in learner.parameters()) / 1e6
    print(
        f"[demo] model {model_dir}: {parameters:.2f}M parameters"
        + (f", warm-started {meta['warm_start_steps']} steps" if meta else "")
    )
    task = build_task(cfg.task, model_dir)
    policy = build_policy(cfg.precision, model_dir)
    engine = build_engine(cfg.engine, str(model_dir), policy)
    print(
        f"[demo] task {task.name!r} (registered: {', '.join(registered_tasks())}); "
        f"engine {engine.name}, precision {policy.name}: {policy.engine_config()}"
    )

    # What a learner does every version: quantize its weights through the policy,
    # calibrate the KV scales, and hand both to the engine.
    tokenizer = load_tokenizer(model_dir)
    calibration = [task.prompt(i) for i in range(32)]
    batch = dict(
        tokenizer(
            [p.text + task.completion(p) for p in calibration], return_tensors="pt", padding=True
        )
    )
    version = version_tensors(learner, policy, batch)
    engine.update_weights(0, dict(version.weights), version.extra)

    shown = [task.prompt(i) for i in range(cfg.samples)]
    sampling = SamplingParams(
        temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
    )
    for prompt, sample in zip(
        shown, engine.generate([p.text for p in shown], sampling), strict=True
    ):
        question = prompt.text.replace("\n", " | ")
        question = question if len(question) <= 70 else question[:67] + "..."
        print(
            f"  {question:<72} -> {sample.text.strip()!r:<10} answer {prompt.answer:>6}  "
            f"reward {task.score(sample.text, prompt):.0f}"
        )

    measured = [task.prompt(cfg.samples + i) for i in range(cfg.eval_prompts)]
    samples = engine.generate([p.text for p in measured], sampling)
    reward = sum(task.score(s.text, measured[s.prompt_index]) for s in samples) / len(samples)
    print(
        f"[demo] mean reward at temperature {cfg.temperature} over {cfg.eval_prompts} "
        f"prompts: {reward:.3f}"
    )

    if cfg.temperature == 1.0:  # the learner's recompute is of the unprocessed distribution
        correction = build_correction(cfg.correction)
        out = correction(*learner_logprobs(learner, samples))
        m = out.metrics
        print(
            f"[demo] mismatch engine vs learner: KL k1 {m['mismatch/kl_k1']:.2e}, "
            f"k3 {m['mismatch/kl_k3']:.2e}, chi2/token {m['mismatch/chi2_token']:.2e}; "
            f"{correction.name} weights mean {m['correction/weight_mean']:.4f} "
            f"[{m['correction/weight_min']:.3f}, {m['correction/weight_max']:.3f}], "
            f"clipped {m['correction/frac_clipped']:.2%}, masked {m['correction/frac_masked']:.2%}"
        )
    print(f"[demo] done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    exit_on_version_flag()
    main()
