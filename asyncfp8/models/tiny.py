"""Tiny Qwen2 (and Qwen3-MoE) models made locally, warm-started on a task they will be
trained on (how and why: docs/running.md, "Tiny models"): the sizes, each task's recipe,
the build, the cache and the models shipped with the package (`asyncfp8/models/shipped/`).

    python -m asyncfp8.models.tiny --size small --task addition --out models/small
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .tokenizer import build_byte_tokenizer
from .warmstart import (
    DEFAULT_TASK,
    REWARD_WINDOW,
    WarmStart,
    describe,
    measure_saved_model,
    warm_start,
)

METADATA_FILE = "asyncfp8_model.json"
# Bump when the recipe changes in a way that must invalidate cached models (2: the
# arithmetic stream leaves out the held-out expressions evaluation scores on; 3: the
# warm-start task is part of the recipe).
RECIPE_VERSION = 3
SHIPPED_DIR = Path(__file__).parent / "shipped"


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
    # A Qwen3-MoE when num_experts > 0: every layer's MLP is num_experts experts of
    # moe_intermediate_size (intermediate_size unused), experts_per_token of them per token.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def fingerprinted(self) -> dict[str, Any]:
        """The fields a model's fingerprint reads: a dense model's leave the MoE ones out,
        so the dense models shipped before MoE existed keep their keys."""
        fields = asdict(self)
        if not self.moe:
            for name in ("num_experts", "experts_per_token", "moe_intermediate_size"):
                fields.pop(name)
        return fields


# For tests: builds and warm-starts in seconds.
TINY = ModelSpec(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# For the demo. hidden 128 fills FP8's 128x128 blocks exactly (q_proj is one full
# block); intermediate 352 = 2.75 blocks and k/v_proj's 64 rows exercise padding.
SMALL = ModelSpec(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SIZES: dict[str, ModelSpec] = {
    "tiny": TINY,
    # Qwen3-MoE for MoE tests: `tiny` with 4 experts of 64, top-2
    "tiny_moe": replace(TINY, num_experts=4, experts_per_token=2, moe_intermediate_size=64),
    "small": SMALL,
    # The MoE demo: `small` with 8 experts of one FP8 block each, top-2, so a token's
    # active MLP (2 x 128) is near `small`'s 352
    "small_moe": replace(SMALL, num_experts=8, experts_per_token=2, moe_intermediate_size=128),
}


# Per task, the recipe that reaches its window on the `small` model. `addition` answers are
# 34 tokens at 3 digits, so checks (sampling 128 answers) are rarer; its teacher forgets a
# carry 65% of the time, so the model learns the digit steps but carries only about a third
# of the time, and RL's reward (the true sum) has one thing to teach. `min_steps` lets it
# learn the steps whole before its reward may stop it.
RECIPES: dict[str, dict[str, Any]] = {
    "arithmetic": {},
    "addition": {
        "steps_per_check": 250,
        "min_steps": 3000,
        "max_steps": 8000,
        "stop_at_reward": 0.1,
        "check_prompts": 128,
        "carry_drop": 0.65,
    },
}


# Where a size needs its own recipe for a task. `tiny` (0.14 M parameters) cannot learn the
# sloppy teacher's worked answers (it never reaches `addition`'s 0.1 stop), so on `addition`
# it learns from the exact teacher and stops after 1,000 steps at 0.1 or more; sampling at
# T = 1 still gets a carry or a digit wrong, which is what RL on it can fix.
SIZE_RECIPES: dict[tuple[str, str], dict[str, Any]] = {
    ("tiny", "addition"): {
        "steps_per_check": 250,
        "min_steps": 1000,
        "max_steps": 4000,
        "stop_at_reward": 0.1,
        "check_prompts": 128,
        "carry_drop": 0.0,
    },
}


def recipe_for(
    task: dict[str, Any] | None = None, size: str | None = None, **overrides: Any
) -> WarmStart:
    """The warm-start recipe for a task (its name and parameters) on a model size: the
    task's recipe, with the size's own where it has one (SIZE_RECIPES)."""
    task = dict(task or DEFAULT_TASK)
    recipe = RECIPES.get(task["name"], {})
    if size is not None and (size, task["name"]) in SIZE_RECIPES:
        recipe = SIZE_RECIPES[(size, task["name"])]
    return WarmStart(task=task, **{**recipe, **overrides})


def warm_start_task(task_cfg: Any) -> dict[str, Any]:
    """The warm-start task for a run's task config: the task itself (its name and
    parameters, without its seed and reward) when it has a recipe here, else
    `arithmetic` (a tiny model cannot be warm-started on GSM8K, say)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(task_cfg, DictConfig):
        task_cfg = OmegaConf.to_container(task_cfg, resolve=True)
    params = {k: v for k, v in dict(task_cfg or {}).items() if k not in ("seed", "reward")}
    return params if params.get("name") in RECIPES else dict(DEFAULT_TASK)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASYNCFP8_CACHE", Path.home() / ".cache" / "asyncfp8")) / "models"


def fingerprint(spec: ModelSpec, recipe: WarmStart, seed: int) -> str:
    blob = json.dumps(
        {
            "spec": spec.fingerprinted(),
            "recipe": asdict(recipe),
            "seed": seed,
            "version": RECIPE_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_metadata(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def build_model(spec: ModelSpec, tokenizer, seed: int):
    """A Qwen2 (dense) or Qwen3-MoE model of this spec, randomly initialized from `seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
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
    if not spec.moe:
        return Qwen2ForCausalLM(Qwen2Config(**common))
    config = Qwen3MoeConfig(
        **common,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.moe_intermediate_size,
        norm_topk_prob=True,  # as Qwen3-30B-A3B: the top-k gate weights sum to 1
    )
    return Qwen3MoeForCausalLM(config)


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


def shipped_model(size: str, seed: int, key: str) -> Path | None:
    """The model of this size, seed and recipe shipped with the package, if there is one."""
    path = SHIPPED_DIR / f"{size}-seed{seed}-{key}"
    meta = read_metadata(path)
    return path if meta and meta.get("fingerprint") == key else None


def shipped_on(size: str, task_name: str, seed: int = 0) -> Path:
    """The shipped model of this size and seed warm-started on the task of this name (e.g.
    the `small` model on `addition` that `make run` starts from)."""
    for path in sorted(SHIPPED_DIR.glob(f"{size}-seed{seed}-*")):
        meta = read_metadata(path)
        if meta and meta["task"]["name"] == task_name:
            return path
    raise FileNotFoundError(
        f"no shipped {size} model (seed {seed}) on {task_name} in {SHIPPED_DIR}"
    )


def make_tiny_model(
    size: str = "tiny",
    out_dir: str | Path | None = None,
    seed: int = 0,
    recipe: WarmStart | None = None,
    force: bool = False,
    progress: bool = True,
    task: dict[str, Any] | None = None,
) -> Path:
    """Build (or find shipped, or in the cache) a model warm-started on `task` (name and
    parameters; default `arithmetic`); returns its directory."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(SIZES)}")
    if recipe is None:
        recipe = recipe_for(task, size)
    elif task is not None:
        recipe = replace(recipe, task=dict(task))
    spec = SIZES[size]
    key = fingerprint(spec, recipe, seed)
    if out_dir is None and not force and (shipped := shipped_model(size, seed, key)):
        return shipped
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
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            model.to(torch.bfloat16).save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            final_reward = measure_saved_model(staging, recipe, seed)
            low, high = REWARD_WINDOW
            if not low <= final_reward <= high:
                raise RuntimeError(
                    f"warm-started model ({size}, {describe(recipe.task)}) scores "
                    f"{final_reward:.3f} once saved in BF16, outside [{low}, {high}]"
                )
            metadata = {
                "fingerprint": key,
                "size": size,
                "seed": seed,
                "task": recipe.task,
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


def parse_task(name: str, params: list[str]) -> dict[str, Any]:
    """{"name": name, key: value, ...} from `key=value` strings (values as YAML reads them)."""
    import yaml

    task: dict[str, Any] = {"name": name}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param takes key=value, got {item!r}")
        task[key] = yaml.safe_load(value)
    return task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.models.tiny",
        description="Write a warm-started tiny Qwen2 or Qwen3-MoE model (HF format, byte "
        "tokenizer) for the bundled tasks.",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--task",
        choices=sorted(RECIPES),
        default=DEFAULT_TASK["name"],
        help="the task to warm-start on (default: %(default)s)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a task parameter as the run's config sets it, e.g. --param digits=3 (repeatable)",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--out", help=f"model directory (default: a cache entry under {default_cache_dir()})"
    )
    target.add_argument(
        "--ship",
        action="store_true",
        help=f"write it where the package ships its models ({SHIPPED_DIR}), for maintainers",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a matching model is there"
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    task = parse_task(args.task, args.param)
    out = args.out
    if args.ship:
        key = fingerprint(SIZES[args.size], recipe_for(task, args.size), args.seed)
        out = SHIPPED_DIR / f"{args.size}-seed{args.seed}-{key}"
    path = make_tiny_model(args.size, out, args.seed, force=args.force, task=task)
    meta = read_metadata(path)
    print(
        f"{path}\n  size={meta['size']} seed={meta['seed']} task={describe(meta['task'])} "
        f"warm-start steps={meta['warm_start_steps']} mean reward at T=1 = "
        f"{meta['mean_reward_t1']:.3f} over {meta['reward_prompts']} prompts "
        f"(built in {meta['build_seconds']} s)"
    )


if __name__ == "__main__":
    main()
