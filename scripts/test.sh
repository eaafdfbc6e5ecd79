#!/usr/bin/env bash
# The test command of the README: sets up .venv, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/part.sh
part venv scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
part suite .venv/bin/python -m pytest "$@"
# tests/tt once more in Python 3.12 with ttnn (the main venv skips them): the host mode needs no card.
# ALSPEC_SKIP_TT=1 leaves this out (.venv-tt takes about 2 minutes and 6.7 GB, mostly torch's CUDA libraries).
if [ "${ALSPEC_SKIP_TT:-0}" != 1 ]; then
    part venv-tt scripts/tt_env.sh
    part tt .venv-tt/bin/python -m pytest tests/tt
fi
