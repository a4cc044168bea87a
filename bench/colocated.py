"""One device, one process: the colocated placement overlapped (async) against in turns
(sync), and in turns the engine's memory released or kept between turns (issue 48).

    python bench/colocated.py --device cuda [--steps 300] [--out bench/results/colocated-<gpu>.json]
    python bench/colocated.py --dry-run      (the same launches on the CPU, a few steps)

Each mode is `make run`'s job (`python -m asyncfp8.launch`: the small model, the addition
task, held-out evaluated) with `run.placement=colocated`, launched as its own process:

| mode | settings |
|---|---|
| async | `run.mode=async` (a rollout thread generates the next step while the learner trains) |
| turns | `run.mode=sync run.release_engine_memory=false` |
| turns_release | `run.mode=sync run.release_engine_memory=true` (see below) |

turns_release: the KV cache and graph dropped after each turn.

Each row: trained samples/s and seconds per step (the run's summary), held-out greedy
pass@1 at the start and the end, and for turns_release the memory given back per turn
(`worker/colocated/memory/released_gib`). The JSON is written after every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table

MODES = {
    "async": ["run.mode=async"],
    "turns": ["run.mode=sync", "run.release_engine_memory=false"],
    "turns_release": ["run.mode=sync", "run.release_engine_memory=true"],
}


def launch(run_dir: Path, device: str, steps: int, settings: list[str], timeout: float) -> dict:
    """One colocated run, launched and read (`read_run`), with its wall time."""
    command = [
        sys.executable,
        "-m",
        "asyncfp8.launch",
        "run.placement=colocated",
        f"run.device={device}",
        f"run.steps={steps}",
        "run.tensorboard=false",
        f"run.dir={run_dir}",
        *settings,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-1500:]
        raise RuntimeError(f"exit {done.returncode}: {tail}")
    return read_run(run_dir) | {"wall_s": time.perf_counter() - started}


def read_run(run_dir: Path) -> dict:
    """A finished run's row: its summary's rate, step time and held-out figures, and the
    memory its engine gave back per turn (0 where it kept it)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    released = [
        record["worker/colocated/memory/released_gib"]
        for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "worker/colocated/memory/released_gib" in record
    ]
    return {
        "trained_samples_per_s": summary["samples_per_s"],
        "seconds_per_step": summary["elapsed_s"] / max(summary["steps"], 1),
        "heldout_greedy_start": summary["eval_pass1_greedy_start"],
        "heldout_greedy_end": summary["eval_pass1_greedy_end"],
        "guard_rollbacks": summary["guard_rollbacks"],
        "released_gib_per_turn": sum(released) / len(released) if released else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, 4 steps a mode")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"no mode {sorted(unknown)}: {', '.join(MODES)}")
    if args.dry_run:
        args.device, args.steps, tag = "cpu", min(args.steps, 4), "dry-run"
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/colocated.py --device cuda: no CUDA GPU here", file=sys.stderr)
            return 1
        from kernels import device_tag

        tag = device_tag()
    else:
        tag = "cpu"
    out = args.out or Path(__file__).resolve().parent / "results" / f"colocated-{tag}.json"
    table = Table(out, steps=args.steps, device=args.device, job="make run's, colocated")
    print(f"{'mode':<14} {'samples/s':>9} {'s/step':>7} {'held-out':>15} {'GiB/turn':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            row = {"mode": mode, "settings": MODES[mode]}
            try:
                row |= launch(
                    Path(scratch) / mode, args.device, args.steps, MODES[mode], args.timeout
                )
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                row["error"] = str(err)[-1500:]
            table.add(row)
            if "error" in row:
                print(f"{mode:<14} failed: {row['error'][-300:]}", flush=True)
                continue
            print(
                f"{mode:<14} {row['trained_samples_per_s']:>9.1f} {row['seconds_per_step']:>7.3f} "
                f"{row['heldout_greedy_start']:>6.3f} -> {row['heldout_greedy_end']:.3f} "
                f"{row['released_gib_per_turn']:>8.3f}",
                flush=True,
            )
    print(f"wrote {out}")
    return 0 if all("error" not in row for row in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
