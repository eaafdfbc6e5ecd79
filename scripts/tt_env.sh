#!/usr/bin/env bash
# Creates .venv-tt (Python 3.12: ttnn wheels exist for 3.10 and 3.12 only) with ttnn, torch, alspec-eval
# and pytest, for backend=tt and tests/tt. Idempotent: a second run only installs what is missing.
# PYTHON picks the interpreter. PyPI has no CPU-only torch for 3.12 (the CPU wheels live on pytorch's own
# index), so torch comes with its CUDA libraries: about 0.55 GB of torch wheel plus about 3 GB of nvidia-*.
set -euo pipefail
cd "$(dirname "$0")/.."
ok() { "$1" -c 'import sys; assert sys.version_info[:2] in ((3, 10), (3, 12))' 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then  # pyenv's shim is on PATH even where 3.12 is not its selected version
    for PYTHON in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 python3.10 ""; do
        [ -n "$PYTHON" ] && ok "$PYTHON" && break
    done
fi
[ -n "$PYTHON" ] && ok "$PYTHON" || {
    echo "tt_env.sh: needs Python 3.12 (or 3.10) for the ttnn wheels; set PYTHON=/path/to/python3.12" >&2
    exit 1
}
[ -x .venv-tt/bin/python ] || "$PYTHON" -m venv .venv-tt
pip() { .venv-tt/bin/python -m pip --disable-pip-version-check -q "$@"; }
.venv-tt/bin/python -c "import torch" 2>/dev/null || pip install torch
.venv-tt/bin/python -c "import ttnn" 2>/dev/null || pip install ttnn
# ttnn needs numpy<2, said here too: otherwise pip meets scipy>=1.18 (numpy>=2) first and backtracks through pandas
# to an sdist that no longer builds. pyarrow>=21 (pulled by datasets>=4.1) needs numpy>=2, so both are held back.
pip install -e ".[tt]" pytest pytest-xdist "numpy<2" "pyarrow<21" "datasets<4.1"
