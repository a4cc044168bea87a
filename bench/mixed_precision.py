"""The mismatch table of docs/precision.md ("A mixed precision"): for a model, each
precision's k3 from the demo (the torch engine's own samples at temperature 1, the FP32
learner's recompute; 256 prompts of the default task, seed 0) and, for the layouts, the
planner's exact KL on the calibration texts and the share of linear FLOPs quantized.

    python bench/mixed_precision.py [--model small] [--budgets 1.3 2 4] [--out FILE]
    python bench/mixed_precision.py --smoothed --only-smoothed --budgets 1.3 2

Rows: bf16, fp8, int8 (whole), NeMo-RL's static rule (first and last decoder layers in
BF16), and `precision=mixed` at each budget, over FP8 and over INT8. `--smoothed` adds
INT8 with a SmoothQuant profile (asyncfp8.precision.profile, folds included, made here
on the task's prompts), whole and mixed at each budget; `--only-smoothed` keeps bf16 and
int8 beside those, for their ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

K3 = re.compile(r"k3 ([0-9.e+-]+),")
REWARD = re.compile(r"mean reward at temperature [0-9.]+ over \d+ prompts: ([0-9.]+)")
LAYOUT = re.compile(
    r"\] (\w+): (\d+)/(\d+) linear layers quantized \((\d+)% of their FLOPs\); "
    r"KL ([0-9.e+-]+) = ([0-9.]+)x"
)


def run(module: str, *overrides: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *overrides], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"{module} {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def demo(model: str, *precision: str) -> dict:
    out = run("asyncfp8.demo", f"model={model}", *precision)
    return {"k3": float(K3.search(out).group(1)), "reward": float(REWARD.search(out).group(1))}


def layout(model: str, base: str, *rule: str) -> tuple[dict, str]:
    out = run("asyncfp8.plan.layout", f"model={model}", f"precision.base={base}", *rule)
    found = LAYOUT.search(out)
    keep = out.split("start every process with: ", 1)[1].splitlines()[0]
    return {
        "layers_quantized": f"{found.group(2)}/{found.group(3)}",
        "flops_quantized": int(found.group(4)) / 100,
        "planner_kl": float(found.group(5)),
        "planner_ratio": float(found.group(6)),
    }, keep


def edges_keep(layers: int) -> str:
    """NeMo-RL's rule: the first and the last decoder layer's linear layers in BF16."""
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    parts += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    names = [f"model.layers.{i}.{p}" for i in (0, layers - 1) for p in parts]
    return "precision.keep=[" + ",".join(f"'{n}'" for n in names) + "]"


def make_profile(model: str, task: str, out: Path) -> Path:
    """A SmoothQuant profile of the run's model on `task`'s prompts."""
    from hydra import compose, initialize_config_module

    from asyncfp8.models.run_model import run_model_dir

    with initialize_config_module("asyncfp8.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"task={task}"])
    run(
        "asyncfp8.precision.profile",
        "--model",
        str(run_model_dir(cfg)),
        "--task",
        task,
        "--out",
        str(out),
    )
    return out


def machine() -> str:
    names = re.findall(r"model name\s*: (.*)", Path("/proc/cpuinfo").read_text())
    return f"{len(names)} x {names[0] if names else platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.3, 2.0, 4.0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--task", default="addition", help="the profile's prompts (--smoothed)")
    parser.add_argument("--smoothed", action="store_true", help="add smoothed INT8 rows")
    parser.add_argument("--only-smoothed", action="store_true", help="bf16, int8 and those")
    args = parser.parse_args()
    rows = []
    started = time.perf_counter()
    plain = ("bf16", "int8") if args.only_smoothed else ("bf16", "fp8", "int8")
    for name in plain:
        rows.append({"precision": name, **demo(args.model, f"precision={name}")})
    for base in () if args.only_smoothed else ("fp8", "int8"):
        keep = edges_keep(args.layers)
        rows.append(
            {
                "precision": f"{base}, first and last layer BF16",
                "flops_quantized": (args.layers - 2) / args.layers,
                **demo(args.model, "precision=mixed", f"precision.base={base}", keep),
            }
        )
        for budget in args.budgets:
            planned, keep = layout(args.model, base, f"precision.budget={budget}")
            measured = demo(args.model, "precision=mixed", f"precision.base={base}", keep)
            rows.append({"precision": f"mixed {base}, budget {budget}", **planned, **measured})
        print(f"[bench] {base} done at {time.perf_counter() - started:.0f} s", flush=True)
    if args.smoothed or args.only_smoothed:
        profile = make_profile(
            args.model, args.task, Path("runs") / "bench-smoothquant.safetensors"
        )
        smooth = f"precision.profile={profile.resolve()}"
        rows.append({"precision": "int8, smoothed", **demo(args.model, "precision=int8", smooth)})
        for budget in args.budgets:
            planned, keep = layout(args.model, "int8", f"precision.budget={budget}", smooth)
            measured = demo(args.model, "precision=mixed", "precision.base=int8", smooth, keep)
            rows.append(
                {"precision": f"mixed int8 smoothed, budget {budget}", **planned, **measured}
            )
        print(f"[bench] smoothed done at {time.perf_counter() - started:.0f} s", flush=True)
    bf16 = rows[0]["k3"]
    print(
        "| precision | k3 (x bf16) | engine reward | linear FLOPs quantized | planner KL (x bf16) |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        planned = (
            f"{row['planner_kl']:.2e} ({row['planner_ratio']:.2f}x)" if "planner_kl" in row else ""
        )
        share = f"{row['flops_quantized']:.0%}" if "flops_quantized" in row else ""
        print(
            f"| {row['precision']} | {row['k3']:.2e} ({row['k3'] / bf16:.2f}x) | "
            f"{row['reward']:.3f} | {share} | {planned} |"
        )
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"machine": machine(), "model": args.model, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
