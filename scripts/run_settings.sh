# Sourced by the study scripts (parity_runs.sh, rejection_runs.sh, learner_forward_runs.sh,
# stability_runs.sh): one launcher run
# per setting and seed, then one report over them all.
#   run_settings OUT_DIR "SEEDS" "name overrides..." ...
# A finished run (its summary.json written) is kept, so a stopped study continues where it
# stopped; $EXTRA holds overrides for every run, $PY the interpreter. The studies in
# docs/results.md ran as one learner and two worker processes, so every run is placed so
# ($PLACEMENT; the launcher's default on one device is now one colocated process).
run_settings() {
  local out=$1 seeds_text=$2
  shift 2
  local seeds seed setting name overrides dir started=$SECONDS
  read -r -a seeds <<< "$seeds_text"
  local py=${PY:-.venv/bin/python}
  for seed in "${seeds[@]}"; do
    for setting in "$@"; do
      read -r name overrides <<< "$setting"
      dir="$out/${name}_seed$seed"
      if [[ -f "$dir/summary.json" ]]; then echo "have $dir"; continue; fi
      rm -rf "$dir"
      echo "[runs] $name seed $seed ($(( (SECONDS - started) / 60 )) min so far)"
      # shellcheck disable=SC2086
      # A run the guard stopped (guard.max_rollbacks in a row; exit status 3) is an
      # outcome: its summary.json is written and kept, and the report counts it under
      # "guard stopped". Any other non-zero end (a crash) leaves no summary.json, is
      # printed, and runs again at the next call of the study.
      "$py" -m asyncfp8.launch ${PLACEMENT:-run.placement=separate run.workers=2} $overrides \
        ${EXTRA:-} run.seed="$seed" run.dir="$dir" | tail -n 3 \
        || echo "[runs] $name seed $seed ended with a non-zero status: $dir"
    done
  done
  echo "[runs] all runs done in $(( (SECONDS - started) / 60 )) min"
  "$py" -m asyncfp8.report "$out"/*_seed* --out "$out/compare.png" --json "$out/summaries.json"
}

# run_chosen OUT_DIR "SEEDS" "name overrides..." ...: run_settings on the settings $SETTINGS
# names (all of them when it is unset); exit 2 when it names none of them.
run_chosen() {
  local out=$1 seeds=$2 setting
  shift 2
  local chosen=()
  for setting in "$@"; do
    if [[ -z "${SETTINGS:-}" || " $SETTINGS " == *" ${setting%% *} "* ]]; then chosen+=("$setting"); fi
  done
  if [[ ${#chosen[@]} -eq 0 ]]; then
    local all=("$@")
    echo "SETTINGS=\"$SETTINGS\" names none of: ${all[*]%% *}" >&2
    exit 2
  fi
  run_settings "$out" "$seeds" "${chosen[@]}"
}
