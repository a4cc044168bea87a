"""Where a run's precision mismatch comes from (docs/results.md, "Where 8-bit rollouts'
mismatch comes from"). One model, the default task's prompts, rollouts sampled by the torch engine
in each precision; then the k3 of those rollout log-probs against several recomputes:

  learner master     the learner's forward as a run computes it (FP32 on a CPU): the
                     `fresh/kl_k3` a run with precision.learner_forward=master reports
  learner quantized  the same with the engine's quantization as fake-quant
                     (precision.learner_forward=quantized)
  engine prefill     the engine's own modules over the whole sequence (its refit-probe
                     path): what decoding token by token adds, in the engine's dtype
and, with --fp32-engine, the same rollouts sampled by an engine computing in FP32 around
its 8-bit GEMMs, against the quantized learner: the mismatch left once both sides round
alike.

    .venv/bin/python scripts/mismatch_sources.py [--checkpoint RUN/model] [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import torch

from asyncfp8.correction.metrics import mismatch_metrics
from asyncfp8.correction.registry import make_batch
from asyncfp8.engines.base import SamplingParams
from asyncfp8.engines.torch_engine import TorchEngine
from asyncfp8.models import load_model, load_tokenizer
from asyncfp8.precision import get_policy, version_tensors

PRECISIONS = ("bf16", "fp8", "int8")


def k3(learner: torch.Tensor, rollout: torch.Tensor) -> float:
    """Mean over tokens of e^δ − δ − 1, δ = log π_learner − log π_rollout: the run's own
    `mismatch/kl_k3` (asyncfp8/correction/metrics.py)."""
    mask = torch.ones(1, learner.numel(), dtype=torch.bool)
    batch = make_batch(learner[None].float(), rollout[None].float(), mask)
    return mismatch_metrics(batch)["mismatch/kl_k3"]


def sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs (temperature 1) of `completion` after `prompt`, one row."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def engine_for(model_dir: Path, precision: str, fp32: bool, learner, calibration):
    """A torch engine running `precision` (its dtype FP32 with `fp32`), given a version of
    `learner`'s weights as a run's learner publishes them (quantized from FP32 masters)."""

    def policy():
        made = get_policy(precision)
        if fp32:
            made.set_engine_dtype(torch.float32)
        return made

    engine = TorchEngine(str(model_dir), policy(), dtype=policy().engine_dtype, cuda_graph=False)
    version = version_tensors(learner, policy(), calibration)
    engine.update_weights(0, dict(version.weights), version.extra)
    return engine


def learner_model(model_dir: Path, precision: str, quantized: bool):
    model = load_model(model_dir, dtype=torch.float32).eval()
    if not quantized:
        return model
    policy = get_policy(precision)
    policy.learner_forward = "quantized"
    policy.bind_model(model.config)
    return policy.prepare_learner(model)


def measure(model_dir: Path, prompts: list[str], precision: str, fp32_engine: bool) -> dict:
    tokenizer = load_tokenizer(model_dir)
    master = learner_model(model_dir, precision, quantized=False)
    calibration = dict(tokenizer(prompts[:32], return_tensors="pt", padding=True))
    engine = engine_for(model_dir, precision, False, master, calibration)
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=40, seed=0)
    samples = [s for s in engine.generate(prompts, sampling) if len(s.token_ids) > 1]
    quantized = learner_model(model_dir, precision, quantized=True)
    rollout = torch.cat([torch.tensor(s.logprobs) for s in samples])

    def recompute(model) -> torch.Tensor:
        return torch.cat([sequence_logprobs(model, s.prompt_ids, s.token_ids) for s in samples])

    prefill = engine.score([s.prompt_ids + s.token_ids for s in samples]).logprobs
    prefill = torch.cat([p[len(s.prompt_ids) - 1 :] for p, s in zip(prefill, samples, strict=True)])
    row = {
        "precision": precision,
        "tokens": int(rollout.numel()),
        "k3_learner_master": k3(recompute(master), rollout),
        "k3_learner_quantized": k3(recompute(quantized), rollout),
        "k3_engine_prefill": k3(prefill, rollout),
    }
    if fp32_engine and precision != "bf16":
        fp32 = engine_for(model_dir, precision, True, master, calibration)
        samples = [s for s in fp32.generate(prompts, sampling) if len(s.token_ids) > 1]
        rollout = torch.cat([torch.tensor(s.logprobs) for s in samples])
        recomputed = torch.cat(
            [sequence_logprobs(quantized, s.prompt_ids, s.token_ids) for s in samples]
        )
        row["k3_fp32_engine_learner_quantized"] = k3(recomputed, rollout)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="a model dir (default: the run's)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (8 samples each)")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--fp32-engine", action="store_true")
    parser.add_argument("--out", default=None, help="a JSON file for the rows")
    args = parser.parse_args()
    from hydra import compose, initialize_config_module

    from asyncfp8.models.run_model import run_model_dir
    from asyncfp8.tasks import build_task

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config")
    model_dir = Path(args.checkpoint) if args.checkpoint else run_model_dir(cfg)
    task = build_task(cfg.task, model_dir)
    prompts = [task.prompt(i).text for i in range(args.prompts)]
    rows, started = [], time.perf_counter()
    print(
        "| precision | tokens | learner master | learner quantized | engine prefill | "
        "FP32 engine vs learner quantized |\n|---|---|---|---|---|---|"
    )
    for precision in args.precisions:
        row = measure(model_dir, prompts, precision, args.fp32_engine)
        rows.append(row)
        fp32 = row.get("k3_fp32_engine_learner_quantized")
        print(
            f"| {precision} | {row['tokens']} | {row['k3_learner_master']:.2e} | "
            f"{row['k3_learner_quantized']:.2e} | {row['k3_engine_prefill']:.2e} | "
            f"{'-' if fp32 is None else f'{fp32:.2e}'} |"
        )
    cpu = re.findall(r"model name\s*: (.*)", Path("/proc/cpuinfo").read_text())
    result = {
        "machine": f"{len(cpu)} x {cpu[0] if cpu else platform.machine()}",
        "model_dir": model_dir.name,
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
