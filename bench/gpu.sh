#!/usr/bin/env bash
# Every GPU measurement of the built-in engine in one device call (shared/gpu/README.md):
#
#   here, once:  mkdir -p .gpu && cp ../shared/gpu/wheels/*.whl .gpu/ && echo /.gpu/ >> .git/info/exclude
#   then:        run(command="bash bench/gpu.sh", carry=[".gpu"])
#   or a chosen step, e.g. run(command="bash bench/gpu.sh longtail", carry=[".gpu"])
#
# It installs the carried wheels (hydra, omegaconf, pyzmq: the GPU machine lacks them) into
# /tmp/site, runs from the source tree (PYTHONPATH), and within one 10-minute call runs, each
# under its own time limit so that one that hangs leaves time to the others:
#   pytest -m gpu                     the GPU tests (kernels, CUDA-graph decode, engine)
#   bench/quantize.py                 weight quantization, Triton vs torch
#   bench/kernels.py                  decode-shaped GEMMs and FP8-KV attention
#   bench/rollout.py --device cuda    the decode table (bf16, fp8, fp8+fp8_kv, int8)
# and, only when named (it needs a call of its own):
#   bench/longtail.py --device cuda   a long-tailed batch of 256 through a 1.5B-shaped model:
#                                     static batches, slots, speculation, adaptive (issue 19)
# A script that is not in the checkout is skipped by name. Logs and JSON go to $OUT (the
# device tool brings it back; bench/results/gpu-run otherwise); summary.txt says what ran,
# how it ended and how long it took. Exits non-zero if anything failed, and at once, having
# run nothing, where torch sees no CUDA GPU.
set -u
cd "$(dirname "$0")/.."

# The steps named on the command line, or the four that fit one call.
WANTED=" ${*:-pytest-gpu quantize kernels rollout} "
wanted() { [[ "$WANTED" == *" $1 "* ]]; }
for name in $WANTED; do
    case $name in
    pytest-gpu | quantize | kernels | rollout | longtail) ;;
    *) echo "bench/gpu.sh: no step $name (pytest-gpu quantize kernels rollout longtail)" >&2; exit 2 ;;
    esac
done

if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu.sh: torch sees no CUDA GPU here; it runs on a lent GPU machine. Nothing was run." >&2
    exit 1
fi
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
if compgen -G ".gpu/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "bench/gpu.sh: no wheels in .gpu/ (hydra, omegaconf, pyzmq); tests that import them fail"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

python3 - > "$OUT/machine.txt" 2>&1 <<'EOF'
import torch, transformers
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
print(f"{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, triton {triton_version}")
EOF
cat "$OUT/machine.txt"
TAG=$(python3 -c 'import sys; sys.path.insert(0, "bench"); from kernels import device_tag; print(device_tag())' 2> /dev/null || echo gpu)

status=0
# step NAME SECONDS FILE COMMAND...: runs COMMAND (which needs FILE) for at most SECONDS.
step() {
    local name=$1 limit=$2 needs=$3
    shift 3
    if [ ! -e "$needs" ]; then
        echo "$name: skipped, $needs is not built" | tee -a "$OUT/summary.txt"
        return
    fi
    echo "== $name (at most ${limit} s): $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT/$name.log"
    local how="exit $rc"
    [ "$rc" -eq 124 ] && how="timed out"
    echo "$name: $how after $((SECONDS - started)) s" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

wanted pytest-gpu && step pytest-gpu 170 tests \
    python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 150 \
    --junitxml "$OUT/pytest-gpu.xml" tests
wanted quantize && step quantize 45 bench/quantize.py \
    python3 bench/quantize.py --out "$OUT/quantize-$TAG.json"
wanted kernels && step kernels 100 bench/kernels.py \
    python3 bench/kernels.py --out "$OUT/kernels-$TAG.json"
wanted rollout && step rollout 230 bench/rollout.py \
    python3 bench/rollout.py --device cuda --out "$OUT/rollout-$TAG.json"
wanted longtail && step longtail 540 bench/longtail.py \
    python3 bench/longtail.py --device cuda --model qwen2.5-1.5b-shaped --batch 256 \
    --slots 64 --threshold 16 --out "$OUT/longtail-$TAG.json"

echo "== summary ($SECONDS s in all; results in $OUT)"
cat "$OUT/summary.txt"
exit $status
