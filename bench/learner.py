"""Train-step speed and memory of the learner, against the micro-batch budget and the
world size.

    python bench/learner.py                  # CPU table -> bench/results/learner-cpu.json
    python bench/learner.py --device cuda    # a 1.5B-shaped Qwen2 on one GPU -> learner-gpu.json

Every row runs in a fresh process (under torchrun for a world size above 1): a
random-init Qwen2 of the row's shape, the real `Learner` (Hydra config, FSDP2, the
chunked log-softmax head), one warm-up step on a small batch, then one timed
`Learner.train` (its `TrainStep`, plus rank 0's ledger line and step metrics) on a batch
of GRPO groups of random tokens (one optimizer step: forward, backward, clip, AdamW).
tokens/s counts every token of the batch (prompt and completion). Peak memory is, on a
CPU, the largest resident set of any rank over its life (model, optimizer and the step;
`rss_before_step_bytes` is what it held before the timed step), on a GPU the peak of
allocated memory during the step. On a CPU each rank is one core (one torch thread). On
a GPU the row also gives the model-FLOPs utilization: (6 × parameters + 6 × layers ×
hidden × sequence length) FLOPs per token (forward and backward, causal attention) over
the GPU's dense BF16 peak from `asyncfp8.plan.gpus`.

The large-vocabulary rows (151,936 tokens, hidden 64) are the case the chunked head is
for: the batch's full-vocabulary FP32 logits would be 64 × 512 × 151,936 × 4 B = 19.9 GB;
the `full-logits` rows measure, on small batches, what the previous recompute (one
forward over the batch, log-softmax over all logits) peaks at.

Each model is built once, in BF16 on the device the rows run on (on a GPU the 1.5B
model takes seconds there; in FP32 on the CPU it took minutes and 6 GB), and saved for
the rows' processes to load. The JSON is written after every row; a row that fails is a
row with an `error`. `--dry-run`: the GPU rows' code on the CPU with a toy model
(bench/gpu.sh --dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, failure, machine

ROOT = Path(__file__).resolve().parent.parent

MODELS = {
    # A few million parameters, vocabulary small: the layers dominate.
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
    ),
    # Qwen2's vocabulary on a tiny body: the output layer dominates.
    "large-vocab": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=151_936,
    ),
    # Qwen2.5-1.5B's architecture at a toy size (--dry-run).
    "toy": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-1.5B's shape (random weights).
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151_936,
        tie_word_embeddings=True,
    ),
}

# (model, samples, sequence length, micro-batch budget, world size[, activation checkpointing])
CPU_ROWS = [
    ("small", 64, 256, 2048, 1),
    ("small", 64, 256, 4096, 1),
    ("small", 64, 256, None, 1),
    ("small", 64, 256, 2048, 2),
    ("small", 64, 256, 4096, 2),
    ("small", 64, 256, None, 2),
    ("large-vocab", 16, 512, 4096, 1),
    ("large-vocab", 64, 512, 4096, 1),
    ("large-vocab", 64, 512, None, 1),
    ("large-vocab", 64, 512, 4096, 2),
]
FULL_LOGITS_ROWS = [("large-vocab", 2, 512), ("large-vocab", 4, 512)]
GPU_ROWS = [
    ("qwen2-1.5b", 64, 512, 8192, 1, False),
    ("qwen2-1.5b", 64, 512, 16384, 1, False),
    ("qwen2-1.5b", 64, 512, 16384, 1, True),
    ("qwen2-1.5b", 64, 1024, 16384, 1, True),
]
DRY_RUN_ROWS = [("toy", 8, 64, 256, 1, True)]
PROMPT_TOKENS = 32
GROUP_SIZE = 8


def build_model(name: str, folder: Path, device: str = "cpu") -> Path:
    """A random-init Qwen2 of `MODELS[name]`'s shape with the byte tokenizer, built in BF16
    on `device` and saved (the learner loads FP32 master weights from it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncfp8.models.tokenizer import build_byte_tokenizer

    out = folder / name
    if (out / "config.json").exists():
        return out
    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        **MODELS[name],
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the rows' processes need the memory
    return out


def groups_of(samples: int, length: int, vocab: int, seed: int = 0) -> list:
    from asyncfp8.sync import Trajectory
    from asyncfp8.train.batches import Group

    rng = random.Random(seed)
    groups = []
    for g in range(samples // GROUP_SIZE or 1):
        members = []
        for i in range(min(GROUP_SIZE, samples)):
            completion = length - PROMPT_TOKENS
            t = Trajectory(
                [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)],
                [rng.randrange(vocab) for _ in range(completion)],
                [-5.0] * completion,
                [0] * completion,
                float(i % 2),
                str(g),
            )
            t.finish_reason = "length"
            members.append(t)
        groups.append(Group(g, g, members))
    return groups


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(spec: dict) -> None:
    """One row, in this process (one rank of it)."""
    from hydra import compose, initialize_config_module

    from asyncfp8.launch.processes import free_ports
    from asyncfp8.learner import Learner
    from asyncfp8.run import distributed

    world = int(os.environ.get("WORLD_SIZE", 1))
    ports = free_ports(3)
    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"model.path={spec['model_dir']}",
                f"run.dir={spec['run_dir']}",
                f"sync.version_port={ports[0]}",
                f"sync.snapshot_port={ports[1]}",
                f"sync.trajectory_port={ports[2]}",
                f"run.groups_per_step={max(1, spec['samples'] // GROUP_SIZE)}",
                f"run.group_size={min(GROUP_SIZE, spec['samples'])}",
                f"run.device={spec['device']}",
                f"run.threads={spec['threads']}",
                "run.tensorboard=false",
                "eval.every=0",
                "correction=token_tis",
                f"optim.micro_batch_tokens={spec['micro_batch_tokens'] or 'null'}",
                f"optim.activation_checkpointing={spec['activation_checkpointing']}",
            ],
        )
    learner = Learner(cfg)
    learner.version = 0
    vocab = MODELS[spec["model"]]["vocab_size"]

    def step(groups) -> None:
        share = distributed.scatter(learner.shares(groups) if learner.ranks.main else None)
        learner.train(share, groups if learner.ranks.main else None)

    cuda = learner.ranks.device.type == "cuda"
    step(groups_of(2 * world, PROMPT_TOKENS + 8, vocab, seed=1))  # warm-up (one-time costs)
    batch = groups_of(spec["samples"], spec["seq_len"], vocab)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else resident_bytes()
    started = time.perf_counter()
    step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    measured = distributed.max_over_ranks({"peak": peak, "before": before, "seconds": seconds})
    measured["parameters"] = sum(p.numel() for p in learner.model.parameters())
    if learner.ranks.main:
        Path(spec["out"]).write_text(json.dumps(measured))
    learner.close()


def full_logits_child(spec: dict) -> None:
    """The previous recompute, for comparison: one forward over the whole batch, the FP32
    log-softmax over every position's logits, and its backward."""
    from asyncfp8.models import load_model
    from asyncfp8.train.batches import batch_tensors

    torch.set_num_threads(spec["threads"])
    model = load_model(spec["model_dir"])
    trajectories = [
        t
        for g in groups_of(spec["samples"], spec["seq_len"], MODELS[spec["model"]]["vocab_size"])
        for t in g.trajectories
    ]
    batch = batch_tensors(trajectories, pad=257)
    before = resident_bytes()
    started = time.perf_counter()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1]
    rows = logp.gather(1, batch.positions[..., None].expand(-1, -1, logp.shape[-1]))
    targets = batch.input_ids.gather(1, batch.positions + 1)
    (rows.gather(-1, targets[..., None])[..., 0] * batch.mask).sum().backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(spec["out"]).write_text(json.dumps({"seconds": seconds, "peak": peak, "before": before}))


def run_row(spec: dict, world: int) -> dict:
    command = [sys.executable]
    if world > 1:
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    command += [str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = os.environ | {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"row {spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(Path(spec["out"]).read_text())


def mfu(parameters: int, model: str, seq_len: int, tokens_per_s: float) -> float | None:
    from asyncfp8.plan.gpus import GPUS

    name = torch.cuda.get_device_name().lower()
    gpu = next((g for key, g in GPUS.items() if key in name), None)
    if gpu is None:
        return None
    shape = MODELS[model]
    per_token = 6 * parameters + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * seq_len
    return per_token * tokens_per_s / gpu.peak_flops("bf16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="JSON to write (default bench/results/learner-<device>.json)")
    parser.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the GPU rows' code on the CPU with a toy model (bench/gpu.sh --dry-run)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        (full_logits_child if spec.get("full_logits") else child)(spec)
        from asyncfp8.run import distributed

        distributed.exit_process(0)  # a rank: no finalization racing gloo's threads
    if args.dry_run:
        args.device = "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/learner.py --device cuda: torch sees no CUDA GPU here (the GPU rows need one; "
            "the CPU table is `python bench/learner.py`)",
            file=sys.stderr,
        )
        return 1
    tag = "dry-run" if args.dry_run else args.device
    out = Path(args.out or ROOT / "bench" / "results" / f"learner-{tag}.json")
    table = Table(
        out,
        what="one Learner.train step (forward, backward, clip, AdamW) on a random-init "
        "Qwen2; * = the full-vocabulary logits recompute this replaced, for comparison",
        models=MODELS,
        load_average=os.getloadavg(),
    )
    header = (
        f"{'model':<12} {'batch':>9} {'budget':>7} {'ranks':>5} {'ckpt':>5} {'step s':>8} "
        f"{'tokens/s':>9} {'peak GB':>8} {'before GB':>9}"
        + (" MFU" if args.device == "cuda" else "")
    )
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as scratch:
        folder = Path(scratch)
        if args.dry_run:
            plan = list(DRY_RUN_ROWS)
        else:
            plan = [(*row, False) for row in CPU_ROWS] if args.device == "cpu" else list(GPU_ROWS)
        specs = [
            {
                "model": model,
                "samples": samples,
                "seq_len": seq_len,
                "micro_batch_tokens": budget,
                "world_size": world,
                "activation_checkpointing": checkpointing,
                "path": "learner",
            }
            for model, samples, seq_len, budget, world, checkpointing in plan
        ]
        if args.device == "cpu" and not args.dry_run:
            specs += [
                {
                    "model": model,
                    "samples": samples,
                    "seq_len": seq_len,
                    "micro_batch_tokens": None,
                    "world_size": 1,
                    "activation_checkpointing": False,
                    "path": "full-logits",
                    "full_logits": True,
                }
                for model, samples, seq_len in FULL_LOGITS_ROWS
            ]
        if args.models:
            specs = [spec for spec in specs if spec["model"] in args.models.split(",")]
        for index, spec in enumerate(specs):
            row = {
                key: spec[key]
                for key in (
                    "path",
                    "model",
                    "samples",
                    "seq_len",
                    "micro_batch_tokens",
                    "world_size",
                    "activation_checkpointing",
                )
            }
            try:
                row |= measure_row(spec, index, folder, args.device)
            except Exception as err:  # the other rows are still measured
                row["error"] = failure(err)
            table.add(row)
            print(describe(row), flush=True)
    table.update(load_average=os.getloadavg())
    print(f"wrote {out} ({machine()['cpu']})")
    return 1 if any("error" in row for row in table.rows) else 0


def measure_row(spec: dict, index: int, folder: Path, device: str) -> dict:
    """Runs one row's process; the row's measured fields."""
    spec |= {
        "model_dir": str(build_model(spec["model"], folder, device)),
        "run_dir": str(folder / f"run{index}"),
        "device": device,
        "out": str(folder / f"row{index}.json"),
        # A CPU rank is one core (threads spinning on a core another rank or process
        # holds slow everything down); a GPU rank keeps the default.
        "threads": 1 if device == "cpu" else max(1, (os.cpu_count() or 1) // 2),
    }
    measured = run_row(spec, spec["world_size"])
    tokens = spec["samples"] * spec["seq_len"]
    row = {
        "device": device,
        "threads": spec["threads"],
        "tokens": tokens,
        "step_s": round(measured["seconds"], 3),
        "tokens_per_s": round(tokens / measured["seconds"], 1),
        "peak_memory_bytes": int(measured["peak"]),
        "rss_before_step_bytes" if device == "cpu" else "allocated_before_step_bytes": int(
            measured["before"]
        ),
    }
    if device == "cuda":
        row["mfu"] = mfu(
            measured["parameters"], spec["model"], spec["seq_len"], row["tokens_per_s"]
        )
    return row


def describe(row: dict) -> str:
    budget = row["micro_batch_tokens"] or "all"
    head = (
        f"{row['model'] + ('*' if row['path'] != 'learner' else ''):<12} "
        f"{row['samples']}×{row['seq_len']:<5} {budget:>7} {row['world_size']:>5} "
        f"{'on' if row['activation_checkpointing'] else 'off':>5} "
    )
    if "error" in row:
        return head + f"failed: {row['error']}"
    before = row.get("rss_before_step_bytes", row.get("allocated_before_step_bytes"))
    return (
        head
        + f"{row['step_s']:>8.2f} {row['tokens_per_s']:>9.0f} "
        + f"{row['peak_memory_bytes'] / 1e9:>8.2f} {before / 1e9:>9.2f}"
        + (f" {row['mfu']:.3f}" if row.get("mfu") is not None else "")
    )


if __name__ == "__main__":
    sys.exit(main())
