#!/usr/bin/env bash
# The suite's line coverage of asyncfp8/, every process counted: the pytest processes and
# what the tests start (launcher, learner ranks under torchrun, workers), through
# coverage.py's `patch = subprocess`. Issue 44 asks that it never falls; docs/testing.md
# has the figures.
#
#   bash scripts/coverage.sh OUT_DIR [pytest arguments...]
#
# e.g. `bash scripts/coverage.sh /tmp/cov -n 2 -m "not cluster"` (what make test runs).
# Writes OUT_DIR/coverage.txt (the report) and OUT_DIR/coverage.json; prints the total.
# Processes killed with SIGKILL (the reliability tests' kills) save nothing: their lines
# count only where another process ran them too. About 1.3x the suite's time (1,057 s
# against 837 s on the 2-core Zen 4 VM).
set -euo pipefail
out=${1:?usage: bash scripts/coverage.sh OUT_DIR [pytest arguments...]}
shift
PY=${PY:-.venv/bin/python}
repo=$(cd "$(dirname "$0")/.." && pwd)
"$PY" -c "import coverage, sys; sys.exit(tuple(map(int, coverage.__version__.split('.')[:2])) < (7, 10))" 2>/dev/null ||
    "$PY" -m pip install --quiet "coverage>=7.10"  # patch = subprocess came in 7.10
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/.coverage*
cat > "$out/coveragerc" <<EOF
[run]
source = $repo/asyncfp8
data_file = $out/.coverage
parallel = true
patch = subprocess, _exit
sigterm = true
disable_warnings = no-data-collected, module-not-imported, module-not-measured
EOF
cd "$repo"
# numba's on-disk cache would skip the LLVM IR code generation in asyncfp8/sync/_xxh3_jit.py
# (it runs only when numba compiles): an empty cache counts it the same in every run
export NUMBA_CACHE_DIR="$out/numba-cache"
rm -rf "$NUMBA_CACHE_DIR"
status=0
"$PY" -m coverage run --rcfile "$out/coveragerc" -m pytest -p no:cacheprovider "$@" || status=$?
"$PY" -m coverage combine --quiet --rcfile "$out/coveragerc" "$out"
"$PY" -m coverage report --rcfile "$out/coveragerc" > "$out/coverage.txt"
"$PY" -m coverage json --quiet --rcfile "$out/coveragerc" -o "$out/coverage.json"
tail -1 "$out/coverage.txt"
echo "pytest exit status $status (coverage counts the tests that ran either way)"
