#!/usr/bin/env bash
# The stability study of issue 45 (item 7): the default job as `python -m asyncfp8.launch`
# runs it (placement auto: on one device, one colocated process, overlapped async; 300
# steps; the guard on), ten seeds of each recommended setting, and the ablations that
# choose the defaults: π_prox of the learner's current weights (correction.proximal=current)
# against the default's, each sample's own version (auto takes it on this job), and the
# guard off. Then one report: held-out mean ± 95% CI and the collapse count with its
# interval, per setting.
#   bash scripts/stability_runs.sh [OUT_DIR] [SEEDS...]   (default: runs/stability, seeds 0..9)
#   SETTINGS="bf16 fp8" bash scripts/stability_runs.sh runs/stability 0 1 2 3 4   (a subset)
# A finished run (its summary.json written) is kept: the study is meant to be run in parts,
# session after session, into the same OUT_DIR. About 3.5 min a run on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/stability}
shift || true
seeds="${*:-0 1 2 3 4 5 6 7 8 9}"
export PLACEMENT="run.placement=auto"
export EXTRA="run.steps=${STEPS:-300} ${EXTRA:-}"
all_settings=(
  "bf16 precision=bf16 correction=token_tis"
  "fp8 precision=fp8 correction=token_tis"
  "fp8kv precision=fp8+fp8_kv correction=token_tis"
  "int8 precision=int8 correction=token_tis"
  # π_prox = the learner's current weights (the default before session 22), not the
  # weights of the version that generated each sample
  "bf16_current precision=bf16 correction=token_tis correction.proximal=current"
  "fp8_current precision=fp8 correction=token_tis correction.proximal=current"
  # the guard off
  "bf16_noguard precision=bf16 correction=token_tis guard.enabled=false"
  "fp8_noguard precision=fp8 correction=token_tis guard.enabled=false"
  # rejection under calibrated bounds (correction/geo_rs.yaml), π_prox of the version
  "fp8_geors precision=fp8 correction=geo_rs"
  "fp8_mis precision=fp8 correction=token_mis"
  # issue 46 (docs/precision.md): FP16 rollouts; mixed INT8 (the launcher measures the
  # layout first)
  "fp16 precision=fp16 correction=token_tis"
  "mixed_int8 precision=mixed precision.base=int8 precision.budget=1.3 correction=token_tis"
  # mixed FP8 at budget 2 (the parity study's session-19 row, before the π_prox fix)
  "mixed_fp8 precision=mixed precision.base=fp8 precision.budget=2 correction=token_tis"
  # item 5: vLLM in a worker process of its own (the placement of session 13's two vLLM
  # runs that collapsed), with and without the guard; the torch engine so placed, guard
  # off, is the control
  "vllm_bf16 engine=vllm precision=bf16 correction=token_tis run.placement=separate run.workers=1"
  "vllm_bf16_noguard engine=vllm precision=bf16 correction=token_tis run.placement=separate run.workers=1 guard.enabled=false"
  "vllm_int8 engine=vllm precision=int8 correction=token_tis run.placement=separate run.workers=1"
  "vllm_int8_noguard engine=vllm precision=int8 correction=token_tis run.placement=separate run.workers=1 guard.enabled=false"
  "separate_bf16_noguard precision=bf16 correction=token_tis run.placement=separate run.workers=1 guard.enabled=false"
  # issue 66: the engine computing in FP32 around its 8-bit GEMMs (no BF16 rounding for the
  # activation quantizer to amplify), with and without training through the quantization
  "fp8_matched precision=fp8 precision.engine_dtype=float32 precision.learner_forward=quantized correction=token_tis"
  "fp8_fp32engine precision=fp8 precision.engine_dtype=float32 correction=token_tis"
  "fp8kv_matched precision=fp8+fp8_kv precision.engine_dtype=float32 precision.learner_forward=quantized correction=token_tis"
  "int8_matched precision=int8 precision.engine_dtype=float32 precision.learner_forward=quantized correction=token_tis"
)
# shellcheck source=scripts/run_settings.sh
source scripts/run_settings.sh
run_chosen "$out" "$seeds" "${all_settings[@]}"
