# Sourced by scripts/test.sh and .ci/run: `part NAME CMD...` runs CMD and prints how long it took, as
# "[part] NAME S s", and appends "NAME S" to $ALSPEC_PARTS when it is set (benchmarks/suite_time.sh reads it).
part() {
    local name=$1 start=$SECONDS
    shift
    "$@"
    local took=$((SECONDS - start))
    echo "[part] $name $took s" >&2
    if [ -n "${ALSPEC_PARTS:-}" ]; then echo "$name $took" >>"$ALSPEC_PARTS"; fi
}
