#!/usr/bin/env bash
# The learner_forward comparison in docs/results.md: FP8 and INT8 rollouts with the
# learner's log-probs from its FP32 master forward or from the engine's quantized forward
# (fake-quant, straight-through gradients); small model, arithmetic (8-token answers, as
# measured there), token TIS.
#   bash scripts/learner_forward_runs.sh [OUT_DIR] [SEEDS...]   (default: runs/learner-forward, seeds 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/learner-forward}
shift || true
STEPS=${STEPS:-300}
settings=(
  "fp8_master precision=fp8 precision.learner_forward=master"
  "fp8_quantized precision=fp8 precision.learner_forward=quantized"
  "int8_master precision=int8 precision.learner_forward=master"
  "int8_quantized precision=int8 precision.learner_forward=quantized"
)
EXTRA="task=arithmetic run.max_new_tokens=8 correction=token_tis run.steps=$STEPS ${EXTRA:-}"
# shellcheck source=scripts/run_settings.sh
source scripts/run_settings.sh
run_settings "$out" "${*:-0 1 2}" "${settings[@]}"
