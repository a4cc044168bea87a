#!/usr/bin/env bash
# The comparison in docs/results.md: the small model on arithmetic, one learner and two
# torch-engine workers, the same budget (run.steps, groups) and seeds for every setting.
#   bash scripts/precision_runs.sh [OUT_DIR] [SEEDS...]      (default: runs/precision, seeds 0 1)
#   EXTRA="run.mode=sync" bash scripts/precision_runs.sh runs/precision-sync 0   (more overrides)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/precision}
shift || true
seeds=("${@:-0 1}")
read -r -a seeds <<< "${seeds[*]}"
PY=${PY:-.venv/bin/python}
settings=(
  "bf16 precision=bf16 correction=token_tis"
  "fp8_none precision=fp8 correction=none"
  "fp8_tis precision=fp8 correction=token_tis"
  "int8_tis precision=int8 correction=token_tis"
)
for seed in "${seeds[@]}"; do
  for setting in "${settings[@]}"; do
    read -r name overrides <<< "$setting"
    dir="$out/${name}_seed$seed"
    if [[ -f "$dir/summary.json" ]]; then echo "have $dir"; continue; fi
    rm -rf "$dir"
    # shellcheck disable=SC2086
    "$PY" -m asyncfp8.launch $overrides ${EXTRA:-} run.seed="$seed" run.dir="$dir" | tail -n 2
  done
done
"$PY" -m asyncfp8.report "$out"/*_seed* --out "$out/compare.png" --json "$out/summaries.json"
