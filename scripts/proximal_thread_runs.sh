#!/usr/bin/env bash
# correction.proximal_thread on against off, paired by seed, on the default job without
# held-out evaluation (docs/results.md, "Speed"): one line per run with its samples/s.
#     bash scripts/proximal_thread_runs.sh [STEPS] [SEEDS...]     (default 120; 0 1 2)
set -eu
cd "$(dirname "$0")/.."
steps=${1:-120}
shift || true
seeds=${*:-0 1 2}
for seed in $seeds; do
    for thread in true false; do
        dir=$(mktemp -d)
        .venv/bin/python -m asyncfp8.launch run.steps="$steps" eval.every=0 run.seed="$seed" \
            correction.proximal_thread="$thread" run.dir="$dir" 2>&1 |
            grep "done in" | sed "s/^/seed $seed proximal_thread=$thread: /"
        rm -rf "$dir"
    done
done
