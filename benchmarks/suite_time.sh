#!/usr/bin/env bash
# Times CI's run (.ci/run) part by part on a fresh clone of HEAD, as CI gets it, and prints each part beside its
# budget; --demo also times the README's main job (scripts/demo.sh) on a fresh clone with pip's cache off and a
# fresh model cache (the model's one-time conversion included), --demo-only that alone. Nothing fails on time
# (timings drift with the machine's load): it prints, and exits non-zero only if a command fails.
#
#   bash benchmarks/suite_time.sh [--demo | --demo-only] [--keep DIR]
#
# Run it with nothing else running. --keep leaves the clones in DIR (default: a temporary folder, removed).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ci=1 demo=0 keep=""
while [ $# -gt 0 ]; do
    case $1 in
        --demo) demo=1 ;;
        --demo-only) demo=1 ci=0 ;;
        --keep) keep=$2; shift ;;
        -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "suite_time.sh: unknown argument $1; see --help" >&2; exit 2 ;;
    esac
    shift
done
work=${keep:-$(mktemp -d)}
mkdir -p "$work"
[ -n "$keep" ] || trap 'rm -rf "$work"' EXIT
parts=$work/parts
: >"$parts"

# Budgets in seconds: .ci/run within 25 minutes in all, the venvs included; the fast tier within 60 s.
declare -A budget=([venv]=150 [suite]=900 [triton-floor]=150 [venv-tt]=200 [tt]=90 [alone-venv]=150 [alone-fast]=120 [alone-exact]=180 [venv-vllm]=240 [vllm]=330 [demo]=300)

if [ "$ci" = 1 ]; then
    git clone -q "$repo" "$work/ci"
    start=$SECONDS
    # pip's cache starts empty, as on CI's fresh machine; .ci/run's later venvs may reuse what its first one
    # downloaded.
    (cd "$work/ci" && PIP_CACHE_DIR=$work/pip-cache ALSPEC_PARTS=$parts PYTEST_ADDOPTS="--durations=10" .ci/run) \
        >"$work/ci.log" 2>&1 || {
        tail -40 "$work/ci.log"; echo "suite_time.sh: .ci/run failed; its log: $work/ci.log" >&2; exit 1; }
    total=$((SECONDS - start))
fi
if [ "$demo" = 1 ]; then
    git clone -q "$repo" "$work/demo"
    start=$SECONDS
    (cd "$work/demo" && PIP_NO_CACHE_DIR=1 ALSPEC_CACHE=$work/model-cache bash scripts/demo.sh) >"$work/demo.log" 2>&1 || {
        tail -40 "$work/demo.log"; echo "suite_time.sh: the demo failed; its log: $work/demo.log" >&2; exit 1; }
    echo "demo $((SECONDS - start))" >>"$parts"
fi

echo "$(date -u +%F) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), HEAD $(git -C "$repo" rev-parse --short HEAD)"
printf '%-12s %8s %8s\n' part seconds budget
while read -r name took; do
    printf '%-12s %8s %8s %s\n' "$name" "$took" "${budget[$name]:--}" \
        "$( [ -n "${budget[$name]:-}" ] && [ "$took" -gt "${budget[$name]}" ] && echo OVER)"
done <"$parts"
[ "$ci" = 1 ] || exit 0
printf '%-12s %8s %8s %s\n' ".ci/run" "$total" 1500 "$([ "$total" -gt 1500 ] && echo OVER)"
echo
echo "The main suite's 10 slowest tests:"
sed -n '/slowest 10 durations/,/^$/p' "$work/ci.log" | sed -n '2,11p'
