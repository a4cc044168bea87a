#!/usr/bin/env bash
# The default job on small_moe with routing replay off and on, paired by seed
# (docs/results.md, "Routing replay on small_moe"); then one table row per run: held-out,
# mean k3, routing mismatch, replayed tokens, samples/s.
#     bash scripts/moe_replay_runs.sh [OUT] [SEEDS...]     (default runs/moe_replay; 0 1 2)
set -eu
cd "$(dirname "$0")/.."
out=${1:-runs/moe_replay}
shift || true
seeds=${*:-0 1 2}
for seed in $seeds; do
    for replay in false true; do
        dir="$out/seed$seed-replay-$replay"
        rm -rf "$dir"
        .venv/bin/python -m asyncfp8.launch model=small_moe run.seed="$seed" \
            correction.routing_replay="$replay" run.dir="$dir" 2>&1 | grep "held-out"
    done
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
for run in sorted(Path(sys.argv[1]).iterdir()):
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "moe/routing_mismatch" in r]
    summary = json.loads((run / "summary.json").read_text())
    k3 = statistics.mean(r["mismatch/kl_k3"] for r in steps if r.get("mismatch/kl_k3") is not None)
    mismatch = statistics.mean(r["moe/routing_mismatch"] for r in steps)
    replayed = statistics.mean(r.get("moe/replayed_tokens", 0) for r in steps)
    print(f"| {run.name} | {summary['eval_pass1_greedy_end']:.3f} ± "
          f"{summary['eval_pass1_greedy_end_se']:.3f} | {summary['eval_pass1_sampled_end']:.3f} | "
          f"{k3:.2e} | {mismatch:.2%} | {replayed:.0f} | {summary['samples_per_s']:.1f} | "
          f"{summary['collapsed']} |")
PY
