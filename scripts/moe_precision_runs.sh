#!/usr/bin/env bash
# The default job on small_moe in each precision, routing replay off and on, paired by seed
# (docs/results.md, "small_moe in 8 bits"); then one table row per run: held-out, mean k3,
# routing mismatch, replayed tokens, samples/s, collapse and late slide.
#     bash scripts/moe_precision_runs.sh [OUT] [PRECISIONS] [SEEDS...]
#     (default runs/moe_precision; "fp8 int8"; 0 1 2)
set -eu
cd "$(dirname "$0")/.."
out=${1:-runs/moe_precision}
precisions=${2:-fp8 int8}
shift 2 || true
seeds=${*:-0 1 2}
for seed in $seeds; do
    for precision in $precisions; do
        for replay in false true; do
            dir="$out/$precision-seed$seed-replay-$replay"
            [ -f "$dir/summary.json" ] && continue  # done in an earlier call
            rm -rf "$dir"
            .venv/bin/python -m asyncfp8.launch model=small_moe run.seed="$seed" \
                precision="$precision" correction.routing_replay="$replay" run.dir="$dir" \
                2>&1 | grep "held-out"
        done
    done
done
.venv/bin/python scripts/moe_runs_table.py "$out"
