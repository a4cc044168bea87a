"""The trained policy, out: a run's checkpoint as a Hugging Face model directory (BF16, with
the tokenizer; `--precision` also writes the weights through that policy, e.g. FP8 for vLLM),
read without a process group (docs/running.md#the-trained-model-out).

    python -m asyncfp8.export RUN_DIR [--step N] [--out DIR] [--precision fp8|int8|...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from asyncfp8 import __version__
from asyncfp8.precision.export import COPIED_FILES
from asyncfp8.run.files import CHECKPOINT_DIR, LEARNER_STATE

MODEL_DIR = "model"  # <run.dir>/model: the exported policy
EXPORT_INFO = "asyncfp8_export.json"


def save_model(
    state: Mapping[str, torch.Tensor], source_dir: str | Path, out: str | Path, info: dict
) -> Path:
    """`state` (the policy's parameters by name, any dtype, on any device) written as a
    BF16 Hugging Face model in `out`, with the side files of `source_dir` (the model the
    run started from). Written beside `out` and renamed over it: a reader never sees half
    a model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    config = AutoConfig.from_pretrained(source_dir, local_files_only=True)
    # A shell on the meta device whose parameters `assign=True` replaces by the BF16
    # tensors below, built with no dtype: given one (or a config naming one), transformers
    # builds under torch.set_default_dtype, which is process-wide, and the learner's
    # publishing thread is computing a refit probe meanwhile.
    config.dtype = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.config.dtype = torch.bfloat16  # what the saved config says
    expected = set(model.state_dict())
    missing = expected - set(state)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")  # one tensor under two names
    if missing:
        raise ValueError(f"the weights to export lack {sorted(missing)[:5]} (of {len(missing)})")
    model.load_state_dict(
        {
            name: tensor.detach().to("cpu", torch.bfloat16)
            for name, tensor in state.items()
            if name in expected
        },
        strict=False,
        assign=True,
    )
    if config.tie_word_embeddings:
        model.tie_weights()
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in COPIED_FILES:  # tokenizer, generation config, chat template
        if (Path(source_dir) / name).exists():
            shutil.copy2(Path(source_dir) / name, staging / name)
    (staging / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return out


def checkpoint_dir(run_dir: Path, step: int | None) -> Path:
    """The run's checkpoint at `step` (None: its latest), refused clearly when absent."""
    folder = run_dir / CHECKPOINT_DIR
    saved = sorted(p.parent for p in folder.glob(f"step_*/{LEARNER_STATE}"))
    if not saved:
        raise SystemExit(
            f"export: {run_dir} has no checkpoint ({folder}/step_*/{LEARNER_STATE}); a run "
            "writes its first before step 1 (is this a run directory?)"
        )
    if step is None:
        return saved[-1]
    wanted = folder / f"step_{step:08d}"
    if wanted not in saved:
        steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in saved)
        raise SystemExit(
            f"export: {run_dir} has no checkpoint at step {step} (it keeps "
            f"run.keep_checkpoints of them: steps {steps})"
        )
    return wanted


def checkpoint_state(checkpoint: Path, source_dir: Path) -> dict[str, torch.Tensor]:
    """The model's FP32 parameters from a sharded learner checkpoint (any world size),
    read without a process group into tensors shaped like the source model's."""
    import torch.distributed.checkpoint as dcp

    from asyncfp8.hf.loading import load_model

    state = {"model": load_model(source_dir, dtype=torch.float32).state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state["model"]


def export_run(
    run_dir: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    precision: str | None = None,
) -> list[Path]:
    """The checkpoint of `run_dir` at `step` as a model directory (and a quantized one
    with `precision`); the directories written."""
    from omegaconf import OmegaConf

    from asyncfp8.models.run_model import run_model_dir
    from asyncfp8.run.resume import CONFIG_FILE

    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        raise SystemExit(f"export: {run_dir} has no {CONFIG_FILE}: not a run directory")
    cfg = OmegaConf.load(run_dir / CONFIG_FILE)
    checkpoint = checkpoint_dir(run_dir, step)
    source = run_model_dir(cfg)
    policy = None
    if precision:
        from asyncfp8.precision import build_policy

        policy = build_policy({"name": precision}, source)  # refused now, before any work
    done = int(checkpoint.name.removeprefix("step_"))
    out = Path(out) if out else run_dir / MODEL_DIR
    info = {"run": str(run_dir.resolve()), "step": done, "source_model": str(source)}
    masters = checkpoint_state(checkpoint, source)
    written = [save_model(masters, source, out, info)]
    if policy is not None:
        from asyncfp8.precision.experts import split_named
        from asyncfp8.precision.export import export_checkpoint, stored_names

        quantized = out.with_name(f"{out.name}-{precision.replace('+', '_')}")
        # From the FP32 masters, not the BF16 model just written: FP16 keeps 3 more bits.
        # An MoE's fused experts under the names the written model stores them by.
        by_name = dict(split_named(masters.items()))
        tensors = ((name, by_name[name]) for name in stored_names(out))
        export_checkpoint(policy, out, quantized, tensors=tensors)
        written.append(quantized)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--version", action="version", version=f"asyncfp8 {__version__}")
    parser.add_argument("run_dir", type=Path, help="a run directory (run.dir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/model")
    parser.add_argument(
        "--precision",
        default=None,
        help="also write OUT-<precision>: the model as that policy ships it (fp8, int8, fp16, ...)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    for path in export_run(args.run_dir, args.step, args.out, args.precision):
        print(f"[export] {path}")
    print(f"[export] done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
