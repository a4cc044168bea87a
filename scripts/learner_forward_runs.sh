#!/usr/bin/env bash
# The learner_forward comparison in docs/results.md: FP8 and INT8 rollouts with the
# learner's log-probs from its FP32 master forward or from the engine's quantized forward
# (fake-quant, straight-through gradients); small model, arithmetic, token TIS.
#   bash scripts/learner_forward_runs.sh [OUT_DIR] [SEEDS...]   (default: runs/learner-forward, seeds 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/learner-forward}
shift || true
seeds=("${@:-0 1 2}")
read -r -a seeds <<< "${seeds[*]}"
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-300}
settings=(
  "fp8_master precision=fp8 precision.learner_forward=master"
  "fp8_quantized precision=fp8 precision.learner_forward=quantized"
  "int8_master precision=int8 precision.learner_forward=master"
  "int8_quantized precision=int8 precision.learner_forward=quantized"
)
for seed in "${seeds[@]}"; do
  for setting in "${settings[@]}"; do
    read -r name overrides <<< "$setting"
    dir="$out/${name}_seed$seed"
    if [[ -f "$dir/summary.json" ]]; then echo "have $dir"; continue; fi
    rm -rf "$dir"
    # shellcheck disable=SC2086
    "$PY" -m asyncfp8.launch $overrides correction=token_tis run.steps="$STEPS" ${EXTRA:-} \
      run.seed="$seed" run.dir="$dir" | tail -n 2
  done
done
"$PY" -m asyncfp8.report "$out"/*_seed* --out "$out/compare.png" --json "$out/summaries.json"
