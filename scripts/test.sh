#!/usr/bin/env bash
# The test command of the README: sets up .venv, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest "$@"
