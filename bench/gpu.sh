#!/usr/bin/env bash
# asyncfp8's GPU measurements in one run on a GPU machine: the GPU tests and the tables of
# bench/, each table saved as soon as it is measured.
#
# What the machine needs: a CUDA GPU (the tables are sized for an 80 GB H100/H200), Python
# with torch (a CUDA build), transformers, triton, safetensors, msgpack, xxhash, tqdm,
# PyYAML, pytest, pytest-timeout, hypothesis and accelerate; and the rest of what asyncfp8
# imports (pyzmq, hydra-core, omegaconf, antlr4-python3-runtime, zstandard) as wheels in
# the checkout's folder .gpu/ (ignored by git), for a machine without a package registry:
#     mkdir -p .gpu && cp ../shared/gpu/wheels/*.whl .gpu/
# (../shared/gpu/README.md says what such machines have). numba is not needed: without it
# weight deltas and checksummed copies run in numpy. The wheels are installed into
# /tmp/site and asyncfp8 runs from this source tree (PYTHONPATH), not installed.
#
# How to start it, from the checkout's root on that machine:
#     bash bench/gpu.sh                  the default steps (within ~9.5 minutes)
#     bash bench/gpu.sh rollout learner  the steps named, in that order
#     bash bench/gpu.sh --dry-run        on a CPU: every step at a toy size through the same
#                                        code, under the same limits (the tests run this)
# A run stops starting steps TOTAL_S (540) seconds in; the summary's last line is the
# command that runs what did not finish.
#
# Where the results go: $OUT (default bench/results/gpu-run): 7 files in a default run (a
# device machine brings back at most 8), 9 in a dry run of every step:
#     summary.txt          the machine, one line per step (how it ended, seconds of its
#                          limit, rows written and failed), the command for what is left
#     log.txt              every step's whole output
#     <step>-<gpu>.json    quantize, kernels, rollout, moe, compiled, learner, longtail
#                          (rollout-h100.json),
#                          each rewritten after every row (a stopped step keeps its rows)
# It exits non-zero if a step failed, timed out or was not reached, and at once, having
# run nothing, where torch sees no CUDA GPU (without --dry-run).
#
# The steps and their limits (estimated before any GPU ran them, at ~2 s per Triton
# compile, ~0.5 s per CUDA-graph capture, ~10 s per Python start with torch and
# transformers; measured on an H100 80GB HBM3, 2026-11-28: pytest-gpu 81 s, quantize 13,
# kernels 13, rollout 93, learner 104; longtail not run yet):
#   (install)           the wheels, one pip run: ~5 s (stopped at 60 s)
#   (check)             one Python start: the GPU, versions, asyncfp8's imports: ~10 s
#                       (stopped at 60 s)
#   pytest-gpu   150 s  pytest -m gpu: collection of the GPU tests' modules, the tiny model, ~40
#                       cases of kernels, graph decode and the GPU learner (~15 Triton
#                       compiles, ~20 captures)
#   quantize      40 s  FP8/INT8 weight quantization, torch and Triton, 4096² and a 7B stream
#   kernels       80 s  56 GEMM and 12 attention rows, each a captured graph (~10 compiles)
#   rollout      300 s  5 precisions × (a 1.5B model built on the GPU, quantized, ~6
#                       compiles) × 5 shapes × (1 + 2 timed) decodes of 64 tokens and of 1,
#                       5 captures (93 s on the H100); the decode step eager in the graph
#   moe           90 s  bench/rollout.py --moe: Qwen3-30B-A3B's layer shape (8 of 48 layers,
#                       128 experts, top-8) in bf16 and fp8, batch 1, 8 and 64 after 256
#                       tokens, the experts as grouped Triton GEMMs (not run on a GPU yet)
#   compiled     240 s  the same with the decode step through torch.compile (engine.compile),
#                       bf16, fp8 and int8 at batch 1 and 64 after 256 tokens: one compile
#                       of the 28-layer step per cell (its time on a GPU not measured yet)
#   -- the default run: ~15 s, then steps stopped at 540 s in all (TOTAL_S): under 10 minutes --
#   learner      240 s  4 rows of bench/learner.py, each a process (~10 s start, a 1.5B
#                       learner loaded, a warm-up and a timed train step)
#   longtail     540 s  issue 19's table: a 256-request batch in 5 modes (a run of its own)
set -u
cd "$(dirname "$0")/.."

ALL_STEPS="pytest-gpu quantize kernels rollout moe compiled learner longtail"
DEFAULT_STEPS="pytest-gpu quantize kernels rollout moe compiled"
TOTAL_S=540
declare -A LIMIT=([pytest-gpu]=150 [quantize]=40 [kernels]=80 [rollout]=200 [moe]=90 [compiled]=240
    [learner]=240 [longtail]=540)

DRY_RUN=0
STEPS=()
for arg in "$@"; do
    case $arg in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *)
        if [[ " $ALL_STEPS " != *" $arg "* ]]; then
            echo "bench/gpu.sh: no step $arg ($ALL_STEPS; or --dry-run)" >&2
            exit 2
        fi
        STEPS+=("$arg")
        ;;
    esac
done
if [ ${#STEPS[@]} -eq 0 ]; then
    # A dry run tries every step; a GPU run the ones that fit one run.
    if [ $DRY_RUN = 1 ]; then read -ra STEPS <<< "$ALL_STEPS"; else read -ra STEPS <<< "$DEFAULT_STEPS"; fi
fi

OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
LOG=$OUT/log.txt
: > "$SUMMARY"
: > "$LOG"
export PYTHONUNBUFFERED=1
# Toy sizes run fastest on one thread (no thread pool to wake for tiny tensors, no spinning
# beside the other work of a shared CPU); their timings are not read.
[ $DRY_RUN = 1 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ $DRY_RUN = 0 ] && compgen -G ".gpu/*.whl" > /dev/null; then
    if ! timeout 60 python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl >> "$LOG" 2>&1; then
        echo "bench/gpu.sh: installing the wheels of .gpu/ failed (log.txt)" | tee -a "$SUMMARY" >&2
        exit 1
    fi
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    [ $DRY_RUN = 1 ] || echo "bench/gpu.sh: no wheels in .gpu/ (see the header): what imports them fails" | tee -a "$SUMMARY"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# The machine, checked in one Python start: its last line is the tag of the JSON names.
CHECK=$(mktemp)
DRY_RUN=$DRY_RUN timeout 60 python3 - > "$CHECK" 2>&1 <<'EOF'
import importlib, importlib.metadata, os, platform, sys

import torch

dry_run = os.environ["DRY_RUN"] == "1"
if not dry_run and not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA GPU here; bench/gpu.sh runs on a GPU machine "
          "(or with --dry-run on a CPU). Nothing was run.")
    sys.exit(3)
if torch.cuda.is_available() and not dry_run:
    major, minor = torch.cuda.get_device_capability()
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"{torch.cuda.get_device_name()} sm{major}{minor}, {memory:.0f} GiB; CUDA {torch.version.cuda}")
else:
    print(f"dry run on the CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
versions, missing = [f"python {platform.python_version()}", f"torch {torch.__version__}"], []
distributions = {"transformers": "transformers", "triton": "triton", "zmq": "pyzmq",
                 "hydra": "hydra-core", "omegaconf": "omegaconf", "zstandard": "zstandard",
                 "msgpack": "msgpack", "xxhash": "xxhash", "safetensors": "safetensors",
                 "yaml": "PyYAML", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
                 "hypothesis": "hypothesis"}
for module, distribution in distributions.items():
    try:
        importlib.import_module(module)
        versions.append(f"{distribution} {importlib.metadata.version(distribution)}")
    except ImportError:
        missing.append(distribution)
print(", ".join(versions))
try:  # what the steps load first: the sync package, the learner, the engine
    for module in ("asyncfp8.sync", "asyncfp8.learner", "asyncfp8.engines.torch_engine"):
        importlib.import_module(module)
except ImportError as err:
    missing.append(f"{err.name} (for {module})")
if missing:
    print(f"missing: {', '.join(missing)} (the wheels of ../shared/gpu/wheels in .gpu/?)")
if dry_run:
    print("dry-run")
else:
    sys.path.insert(0, "bench")
    from kernels import device_tag
    print(device_tag())
sys.exit(4 if missing else 0)
EOF
check=$?
if [ $check != 0 ] && [ $check != 4 ]; then # no GPU (3), or the check itself failed
    tee -a "$SUMMARY" < "$CHECK" >&2
    rm -f "$CHECK"
    exit 1
fi
TAG=$(tail -n 1 "$CHECK") # the rest is the machine
sed '$d' "$CHECK" >> "$SUMMARY"
rm -f "$CHECK"
status=$((check != 0)) # 4: a package is missing; the steps say what it breaks
cat "$SUMMARY"

DRY=()
[ $DRY_RUN = 1 ] && DRY=(--dry-run)
# limited SECONDS COMMAND...: the command, logged, stopped after SECONDS.
limited() {
    local seconds=$1
    shift
    echo "\$ $*" >> "$LOG"
    timeout --kill-after=10 "$seconds" "$@" >> "$LOG" 2>&1
}
# run_step NAME SECONDS: the step's command (a bench writes its table to $OUT/NAME-TAG.json).
run_step() {
    local json=$OUT/$1-$TAG.json
    case $1 in
    # Only the modules that hold GPU tests are collected (the whole suite's collection
    # costs seconds more and selects nothing else).
    pytest-gpu) limited "$2" python3 -m pytest -m gpu -v -rfEs -p no:cacheprovider \
        --timeout 120 --continue-on-collection-errors $(grep -rl "mark.gpu" tests | sort) ;;
    quantize) limited "$2" python3 bench/quantize.py "${DRY[@]}" --out "$json" ;;
    kernels) limited "$2" python3 bench/kernels.py "${DRY[@]}" --out "$json" ;;
    rollout) limited "$2" python3 bench/rollout.py --device cuda --repeats 2 --compile off \
        "${DRY[@]}" --out "$json" ;;
    moe) limited "$2" python3 bench/rollout.py --device cuda --moe --repeats 2 --compile off \
        --precisions bf16,fp8 --contexts short --batches 1,8,64 "${DRY[@]}" --out "$json" ;;
    compiled) limited "$2" python3 bench/rollout.py --device cuda --repeats 2 --compile on \
        --precisions bf16,fp8,int8 --contexts short --batches 1,64 "${DRY[@]}" --out "$json" ;;
    learner) limited "$2" python3 bench/learner.py --device cuda "${DRY[@]}" --out "$json" ;;
    longtail) limited "$2" python3 bench/longtail.py --device cuda --model qwen2.5-1.5b-shaped \
        --batch 256 --slots 64 --threshold 16 "${DRY[@]}" --out "$json" ;;
    esac
}
# What a table holds: ", <rows> rows, <failed> failed" (nothing where there is no table).
rows_of() {
    [ -f "$1" ] || return 0
    python3 -c 'import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
failed = sum(1 for row in rows if row.get("error"))
print(", %d rows, %d failed" % (len(rows), failed))' "$1" 2> /dev/null
}

LEFT=()
for name in "${STEPS[@]}"; do
    left=$((TOTAL_S - SECONDS))
    limit=${LIMIT[$name]}
    if [ $left -lt 20 ]; then
        echo "$name: not started, ${left} s left of the run's $TOTAL_S" | tee -a "$SUMMARY"
        LEFT+=("$name")
        status=1
        continue
    fi
    [ $limit -gt $left ] && limit=$left
    echo "== $name (at most $limit s)" | tee -a "$LOG"
    started=$SECONDS
    lines=$(wc -l < "$LOG")
    run_step "$name" "$limit"
    rc=$?
    tail -n +$((lines + 1)) "$LOG" | tail -n 25
    rm -f "$OUT"/*.tmp # a table's write cut short by the limit
    how="ok"
    case $rc in
    0) ;;
    124 | 137) how="timed out" ;;
    *) how="exit $rc" ;;
    esac
    if [ $name = pytest-gpu ]; then
        counts=$(tail -n +$((lines + 1)) "$LOG" | grep -E '^=+ .* in [0-9.]+s' | tail -n 1 | tr -d '=')
        extra=${counts:+,$counts}
    else
        extra=$(rows_of "$OUT/$name-$TAG.json")
    fi
    echo "$name: $how after $((SECONDS - started)) of $limit s$extra" | tee -a "$SUMMARY"
    if [ $rc != 0 ]; then
        status=1
        LEFT+=("$name")
    fi
done

echo "== $SECONDS s in all; results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$SUMMARY"
if [ ${#LEFT[@]} -gt 0 ]; then
    echo "not finished: ${LEFT[*]}; next run: bash bench/gpu.sh ${DRY[*]:+${DRY[*]} }${LEFT[*]}" | tee -a "$SUMMARY"
fi
exit $status
