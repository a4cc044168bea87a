# Sourced by the study scripts (parity_runs.sh, learner_forward_runs.sh): one launcher run
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
      "$py" -m asyncfp8.launch ${PLACEMENT:-run.placement=separate run.workers=2} $overrides \
        ${EXTRA:-} run.seed="$seed" run.dir="$dir" | tail -n 3
    done
  done
  echo "[runs] all runs done in $(( (SECONDS - started) / 60 )) min"
  "$py" -m asyncfp8.report "$out"/*_seed* --out "$out/compare.png" --json "$out/summaries.json"
}
