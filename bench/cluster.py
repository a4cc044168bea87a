"""The same job under the built-in launcher and on a Ray cluster (`run.ray=true`), on
this machine: Ray's overhead in trained samples per second, and the time from submit
to the first trained step.

    python bench/cluster.py [--model-path DIR] [--steps 60] [--repeats 4] [--keep DIR]
        [--out bench/results/cluster-cpu.json]

The Ray cluster is one node made here (`ray.cluster_utils.Cluster`, with as many CPUs
as the launcher's processes use), so both runs have the same cores and the workers use
shared memory in both (they share the learner's node). Runs alternate (launcher, Ray,
Ray, launcher, ...) so that a machine whose load drifts weighs on both alike, and each
repeat's pair gives one ratio (their mean with its 95% interval is printed). Trained
samples/s counts the steady state (the first `--skip` steps, start-up included, left
out); submit-to-first-step is from the command's start to the first step in the
learner's ledger (the cluster's own start is not in it: it is running before a job is
submitted, as on a real cluster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.learner.ledger import read_ledger
from asyncfp8.report.stats import mean_ci
from asyncfp8.report.summary import per_step
from bench.common import write_json

MODES = {"launcher": [], "ray": ["run.ray=true"]}

# Which part of a run a process is, by its command line: the job's own processes, Ray's
# actors that hold them, and Ray's daemons.
ROLES = (
    ("asyncfp8.learner", "learner"),
    ("asyncfp8.worker", "workers"),
    ("asyncfp8.launch", "driver"),
    ("ray::", "ray actors"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs"),
    ("ray", "ray other"),
)


def role_of(command: str) -> str:
    return next((role for marker, role in ROLES if marker in command), "other")


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """Each live process's role and CPU seconds so far (user + system)."""
    snapshot = {}
    for process in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        times, command = process.info["cpu_times"], process.info["cmdline"] or []
        if times is None or process.pid == os.getpid():
            continue
        snapshot[process.pid] = (
            role_of(" ".join(command) or process.info["name"] or ""),
            times.user + times.system,
        )
    return snapshot


def cpu_by_role(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores each role kept busy between two snapshots (a process born in between counts
    from zero; one that died in between is lost, which the job's own never do)."""
    busy = defaultdict(float)
    for pid, (role, used) in after.items():
        busy[role] += used - before.get(pid, (role, 0.0))[1]
    return {role: round(used / seconds, 4) for role, used in sorted(busy.items())}


def paired_ratios(rows: list[dict], numerator: str, denominator: str) -> dict:
    """Each repeat's `numerator` run against the `denominator` run beside it, in trained
    samples/s: the pairs share the load the machine had at the time, so their ratios
    spread less than the medians' ratio. Their mean, its 95% half-width (None for one
    pair), and `interval`, that as text."""
    by_repeat = {(r["repeat"], r["mode"]): r["trained_samples_per_s"] for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    ratios = [by_repeat[(i, numerator)] / by_repeat[(i, denominator)] for i in repeats]
    mean, half = mean_ci(ratios)
    interval = "n=1, no CI" if half is None else f"95% CI ±{half:.3f}"
    return {"ratios": ratios, "mean": mean, "ci95_half_width": half, "interval": interval}


def measure(mode: str, args, run_dir: Path, env: dict[str, str], modes=MODES) -> dict:
    """One run of the job, `modes[mode]` its overrides: trained samples/s over the steady
    state, the seconds from submit to the first step, and where the cores went."""
    command = [
        sys.executable,
        "-m",
        "asyncfp8.launch",
        f"model={args.model}",
        *([f"model.path={args.model_path}"] if args.model_path else []),
        "task=arithmetic",
        "run.max_new_tokens=8",
        f"run.steps={args.steps}",
        "run.workers=2",
        "run.threads=1",
        "run.placement=separate",
        "run.tensorboard=false",
        "eval.every=0",
        f"run.dir={run_dir}",
        *modes[mode],
    ]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first_step = window_start = None
    while process.poll() is None:
        steps = len(read_ledger(run_dir)) if (run_dir / "ledger.jsonl").exists() else 0
        if steps and first_step is None:
            first_step = time.perf_counter() - started
        if steps >= args.skip and window_start is None:
            window_start, cpu_before, system_before = (
                time.perf_counter(),
                cpu_snapshot(),
                psutil.cpu_times(),
            )
        if steps >= args.steps - 1 and window_start is not None:
            break
        time.sleep(0.1)
    # where the two cores went over the steady state: what each role used, and what
    # stood idle (a Ray run that is slower with idle cores waits; with none, it competes)
    window = time.perf_counter() - window_start
    busy = cpu_by_role(cpu_before, cpu_snapshot(), window)
    system_after = psutil.cpu_times()
    busy["idle"] = round((system_after.idle - system_before.idle) / window, 4)
    output = process.communicate()[0]
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{mode}: the run failed\n{output[-3000:]}")
    records = per_step(run_dir)
    first, last = records[args.skip - 1], records[-1]
    samples = (last["step"] - first["step"]) * 8 * 8  # the default groups_per_step x group_size
    return {
        "mode": mode,
        "trained_samples_per_s": samples / (last["time/elapsed_s"] - first["time/elapsed_s"]),
        "submit_to_first_step_s": first_step,
        "wall_s": wall,
        "cores_busy_in_steady_state": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--model", default="small")
    parser.add_argument("--model-path", default=None, help="a model made already (model.path)")
    parser.add_argument("--out", default="bench/results/cluster-cpu.json")
    parser.add_argument(
        "--keep", default=None, help="keep each run's directory under this one (default: none kept)"
    )
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    # one CPU for the learner and one per worker: what run.ray_learner / run.ray_worker ask
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False}
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    rows = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(args.keep or scratch)
            root.mkdir(parents=True, exist_ok=True)
            for repeat in range(args.repeats):
                # the order swaps every repeat, so neither mode always runs on a warmer machine
                for mode in list(MODES)[:: 1 if repeat % 2 == 0 else -1]:
                    row = measure(mode, args, root / f"{mode}-{repeat}", env)
                    rows.append({**row, "repeat": repeat})
                    busy = ", ".join(
                        f"{role} {cores:.2f}"
                        for role, cores in row["cores_busy_in_steady_state"].items()
                    )
                    print(
                        f"{mode:<9} #{repeat}: "
                        f"{row['trained_samples_per_s']:7.1f} trained samples/s, "
                        f"first step {row['submit_to_first_step_s']:5.1f} s after submit; "
                        f"cores: {busy}",
                        flush=True,
                    )
    finally:
        cluster.shutdown()
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            "trained_samples_per_s_median": statistics.median(
                r["trained_samples_per_s"] for r in mine
            ),
            "submit_to_first_step_s_median": statistics.median(
                r["submit_to_first_step_s"] for r in mine
            ),
        }
    ratio = (
        summary["ray"]["trained_samples_per_s_median"]
        / summary["launcher"]["trained_samples_per_s_median"]
    )
    paired = paired_ratios(rows, "ray", "launcher")
    print(
        f"\nRay / launcher, trained samples/s: {ratio:.3f} of the medians (overhead "
        f"{1 - ratio:+.1%}); per repeat {paired['mean']:.3f} ({paired.pop('interval')}); "
        f"first step "
        f"{summary['ray']['submit_to_first_step_s_median']:.1f} s vs "
        f"{summary['launcher']['submit_to_first_step_s_median']:.1f} s after submit"
    )
    path = write_json(
        args.out,
        {
            "benchmark": "cluster",
            "model": args.model_path or args.model,
            "steps": args.steps,
            "skip": args.skip,
            "workers": 2,
            "load_average_at_end": os.getloadavg(),
            "summary": summary,
            "ray_over_launcher_samples_per_s": ratio,
            "ray_over_launcher_paired": paired,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
