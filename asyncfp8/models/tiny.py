"""Tiny Qwen2 models made locally, warm-started on the arithmetic task.

A random model scores zero reward and RL on a CPU cannot lift it in minutes; a
perfect one leaves RL nothing to do. So the factory trains a fresh model with a short
supervised pass on the task, checking the temperature-1 sampled reward as it goes,
and stops once that reward is inside a window (default: at least 0.3, backing off any
chunk of steps that overshoots 0.6), well within the 0.1-0.7 the rest of the project
expects. The result is saved with `save_pretrained` (BF16 weights, a byte-level
tokenizer) and cached: the same size, seed and recipe are built once per directory.

    python -m asyncfp8.models.tiny --size small --out models/small
    from asyncfp8.models import make_tiny_model; path = make_tiny_model("tiny")
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from asyncfp8.tasks import ArithmeticTask, Prompt

from .sampling import mean_reward
from .tokenizer import build_byte_tokenizer

METADATA_FILE = "asyncfp8_model.json"
# Bump when the recipe changes in a way that must invalidate cached models (2: the
# arithmetic stream leaves out the held-out expressions evaluation scores on).
RECIPE_VERSION = 2
REWARD_WINDOW = (0.1, 0.7)


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 32  # vLLM's CPU attention kernels start at head size 32
    vocab_size: int = 320  # 256 bytes + eos + pad, rounded up to a multiple of 64
    max_position_embeddings: int = 512


SIZES: dict[str, ModelSpec] = {
    # For tests: builds and warm-starts in seconds.
    "tiny": ModelSpec(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    # For the demo. hidden 128 fills FP8's 128x128 blocks exactly (q_proj is one full
    # block); intermediate 352 = 2.75 blocks and k/v_proj's 64 rows exercise padding.
    "small": ModelSpec(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


@dataclass(frozen=True)
class WarmStart:
    """The supervised pass that gives RL a policy with room to improve."""

    max_operand: int = 12
    learning_rate: float = 3e-3
    batch_size: int = 64
    steps_per_check: int = 25
    max_steps: int = 4000
    stop_at_reward: float = 0.3
    overshoot_reward: float = 0.6
    check_prompts: int = 256
    final_prompts: int = 512
    max_new_tokens: int = 8


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASYNCFP8_CACHE", Path.home() / ".cache" / "asyncfp8")) / "models"


def fingerprint(spec: ModelSpec, recipe: WarmStart, seed: int) -> str:
    blob = json.dumps(
        {"spec": asdict(spec), "recipe": asdict(recipe), "seed": seed, "version": RECIPE_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_metadata(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def build_model(spec: ModelSpec, tokenizer, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def supervised_batch(
    tokenizer, task: ArithmeticTask, prompts: list[Prompt]
) -> dict[str, torch.Tensor]:
    """Prompt + reference completion + eos, right-padded; loss only on the completion."""
    rows, labels = [], []
    for prompt in prompts:
        prompt_ids = tokenizer(prompt.text)["input_ids"]
        target_ids = tokenizer(task.completion(prompt))["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + target_ids)
        labels.append([-100] * len(prompt_ids) + target_ids)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def warm_start(model, tokenizer, recipe: WarmStart, seed: int, progress: bool = True) -> dict:
    """Train until the sampled reward reaches `stop_at_reward`; a chunk of steps that
    overshoots `overshoot_reward` is undone and retried at half the learning rate."""
    train_task = ArithmeticTask(seed=seed, max_operand=recipe.max_operand)
    check_task = ArithmeticTask(seed=seed + 10_000, max_operand=recipe.max_operand)
    check_prompts = [check_task.prompt(i) for i in range(recipe.check_prompts)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    step, reward, history = 0, 0.0, []
    bar = tqdm(
        total=recipe.max_steps, desc="warm-start", disable=None if progress else True, leave=False
    )
    model.train()
    while reward < recipe.stop_at_reward:
        if step >= recipe.max_steps:
            bar.close()
            raise RuntimeError(
                f"warm-start reached reward {reward:.3f} < {recipe.stop_at_reward} after "
                f"{step} steps; raise max_steps or learning_rate"
            )
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), step)
        for _ in range(recipe.steps_per_check):
            start = step * recipe.batch_size
            batch = supervised_batch(
                tokenizer,
                train_task,
                [train_task.prompt(start + i) for i in range(recipe.batch_size)],
            )
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            bar.update(1)
        reward = mean_reward(
            model, tokenizer, check_task, check_prompts, recipe.max_new_tokens, seed=seed
        )
        history.append({"step": step, "loss": round(loss.item(), 4), "reward": reward})
        bar.set_postfix(loss=f"{loss.item():.3f}", reward=f"{reward:.3f}")
        if reward > recipe.overshoot_reward:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            step = saved[2]
            for group in optimizer.param_groups:
                group["lr"] /= 2
            reward = 0.0
    bar.close()
    return {"steps": step, "history": history}


@contextmanager
def _exclusive(lock_path: Path):
    """Serializes builds of one directory across processes (e.g. several workers)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def make_tiny_model(
    size: str = "tiny",
    out_dir: str | Path | None = None,
    seed: int = 0,
    recipe: WarmStart | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build (or find in the cache) a warm-started tiny model; returns its directory."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(SIZES)}")
    spec, recipe = SIZES[size], recipe or WarmStart()
    key = fingerprint(spec, recipe, seed)
    out = Path(out_dir) if out_dir else default_cache_dir() / f"{size}-seed{seed}-{key}"
    out = out.expanduser().resolve()

    lock_name = hashlib.sha256(str(out).encode()).hexdigest()[:16] + ".lock"
    with _exclusive(default_cache_dir() / "locks" / lock_name):
        existing = read_metadata(out)
        if existing and existing.get("fingerprint") == key and not force:
            return out
        if out.exists() and any(out.iterdir()) and existing is None:
            raise FileExistsError(
                f"{out} exists and is not an asyncfp8 tiny model; refusing to overwrite it"
            )

        started = time.perf_counter()
        tokenizer = build_byte_tokenizer()
        model = build_model(spec, tokenizer, seed)
        trained = warm_start(model, tokenizer, recipe, seed, progress)

        # Build beside the target and rename, so a crash never leaves a half-written model
        # that a later call would take for a finished one.
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            model.to(torch.bfloat16).save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            final_reward = measure_saved_model(staging, recipe, seed)
            low, high = REWARD_WINDOW
            if not low <= final_reward <= high:
                raise RuntimeError(
                    f"warm-started model scores {final_reward:.3f}, outside [{low}, {high}]"
                )
            metadata = {
                "fingerprint": key,
                "size": size,
                "seed": seed,
                "spec": asdict(spec),
                "recipe": asdict(recipe),
                "warm_start_steps": trained["steps"],
                "history": trained["history"],
                "mean_reward_t1": final_reward,
                "reward_prompts": recipe.final_prompts,
                "build_seconds": round(time.perf_counter() - started, 1),
            }
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def measure_saved_model(model_dir: Path, recipe: WarmStart, seed: int) -> float:
    """Mean temperature-1 reward of the saved (BF16) model on prompts it was not tuned on."""
    from .loading import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir, dtype=torch.bfloat16), load_tokenizer(model_dir)
    task = ArithmeticTask(seed=seed + 20_000, max_operand=recipe.max_operand)
    prompts = [task.prompt(i) for i in range(recipe.final_prompts)]
    return mean_reward(model, tokenizer, task, prompts, recipe.max_new_tokens, seed=seed + 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.models.tiny",
        description="Write a warm-started tiny Qwen2 model (HF format, char tokenizer) for the bundled tasks.",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--out", help=f"model directory (default: a cache entry under {default_cache_dir()})"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a matching model is there"
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = make_tiny_model(args.size, args.out, args.seed, force=args.force)
    meta = read_metadata(path)
    print(
        f"{path}\n  size={meta['size']} seed={meta['seed']} warm-start steps={meta['warm_start_steps']} "
        f"mean reward at T=1 = {meta['mean_reward_t1']:.3f} over {meta['reward_prompts']} prompts "
        f"(built in {meta['build_seconds']} s)"
    )


if __name__ == "__main__":
    main()
