#!/usr/bin/env bash
# The arithmetic-era comparison in docs/results.md ("Precision and correction"): four of
# scripts/parity_runs.sh's settings on the `arithmetic` task, 8-token answers, 500 steps.
#   bash scripts/precision_runs.sh [OUT_DIR] [SEEDS...]      (default: runs/precision, seeds 0 1)
#   EXTRA="run.mode=sync" bash scripts/precision_runs.sh runs/precision-sync 0   (more overrides)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/precision}
shift || true
SETTINGS="bf16 fp8_none fp8_tis int8_tis" \
  EXTRA="task=arithmetic run.max_new_tokens=8 run.steps=500 ${EXTRA:-}" \
  exec bash scripts/parity_runs.sh "$out" "${@:-0 1}"
