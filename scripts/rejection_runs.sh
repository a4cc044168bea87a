#!/usr/bin/env bash
# Rejection that does not starve (issue 45, item 4; docs/results.md "Rejection bounds from
# the measured mismatch"): FP8 with geometric rejection and token MIS under bounds
# calibrated on the first step (correction.target_rejected) and the starved-update rule,
# beside BF16 and the harsh positive control, on the parity testbed (200 steps a run).
#   bash scripts/rejection_runs.sh [OUT_DIR] [SEEDS...]    (default: runs/rejection, seeds 0 1 2)
#   SETTINGS="fp8_geors_cal bf16" bash scripts/rejection_runs.sh ...   (a subset, by name)
# A finished run (its summary.json written) is kept, so a stopped study continues.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/rejection}
shift || true
seeds="${*:-0 1 2}"
export PYTHONPATH="$PWD/examples${PYTHONPATH:+:$PYTHONPATH}"
export EXTRA="run.steps=${STEPS:-200} ${EXTRA:-}"
harsh="precision._target_=harsh_int4_policy.IntWeightOnlyPolicy"
all_settings=(
  # geo_rs's conf calibrates its bounds (target_rejected 0.05); π_prox of each token's own
  # version, so that the ratio it bounds is the precision's alone, as at calibration
  "fp8_geors_cal precision=fp8 correction=geo_rs correction.proximal=version"
  "bf16 precision=bf16 correction=token_tis"
  # the positive control must be free to fail: the guard (on by default) stops it within
  # a few steps (3 rollbacks in a row on a token with |log ρ| > 20)
  "harsh_none $harsh correction=none guard.enabled=false"
  # the same calibrated bounds with π_prox = the current weights (staleness in the ratio)
  "fp8_geors_cal_current precision=fp8 correction=geo_rs"
  # token MIS: its fixed 0.5-5 bounds, π_prox of the token's own version
  "fp8_mis_version precision=fp8 correction=token_mis correction.proximal=version"
  "fp8_mis precision=fp8 correction=token_mis"
)
# shellcheck source=scripts/run_settings.sh
source scripts/run_settings.sh
run_chosen "$out" "$seeds" "${all_settings[@]}"
