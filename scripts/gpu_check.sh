#!/usr/bin/env bash
# The first thing to run on a CUDA machine (no network: the project and lm-eval come as wheels, docs/gpu.md):
# the GPU tests, the compile matrix for this GPU, and the kernel (contiguous and paged cache), adapter, shared-prefill
# sweep and rolling-scoring memory benchmarks on the Llama-3-8B shape. Writes results/gpu_check/<device>.md: the device, the versions, every figure and
# pass/fail per part. Exits 1 if a part failed.
#
#   bash scripts/gpu_check.sh [--out DIR] [--part-timeout SECONDS] [--quick]
#
# --part-timeout stops a part that runs longer (it fails; the report keeps its output so far and the next part
# runs); --quick runs the benchmarks with fewer prompts, tokens and rounds and leaves out the compile matrix and the
# memory benchmark, for a machine lent by the minute (within 8 minutes on an H100). Each part's figures are printed
# as it ends, the kernel table first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
outdir=results/gpu_check
part_timeout=0
quick=0
while [ $# -gt 0 ]; do
    case $1 in
        --out) outdir=$2; shift 2 ;;
        --part-timeout) part_timeout=$2; shift 2 ;;
        --quick) quick=1; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
device=$("$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0).replace(' ', '_'))") || exit 1
out="$outdir/$device.md"
mkdir -p "$outdir"
log=$(mktemp -d)
status=0
{
    echo "# GPU check: ${device//_/ }"
    echo
    echo "$(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    "$PY" -c "import torch, transformers, triton, lm_eval; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}, triton {triton.__version__}, lm-eval {lm_eval.__version__}')" 2>&1
} > "$out"
part() {  # part NAME TARGET COMMAND...: runs it, appends its output and pass/fail to the report
    local name=$1 target=$2
    shift 2
    local start=$SECONDS
    if [ "$part_timeout" -gt 0 ]; then
        timeout --kill-after=10 "$part_timeout" "$@" > "$log/$name.txt" 2>&1
    else
        "$@" > "$log/$name.txt" 2>&1
    fi
    local rc=$?
    [ $rc = 124 ] && echo "(stopped at --part-timeout $part_timeout s)" >> "$log/$name.txt"
    [ $rc = 0 ] || status=1
    {
        echo
        echo "## $name: $([ $rc = 0 ] && echo pass || echo "FAIL (exit $rc)") in $((SECONDS - start)) s"
        echo
        echo "Target: $target"
        echo
        echo '```'
        tail -n 40 "$log/$name.txt"
        echo '```'
    } >> "$out"
    echo "[gpu_check] $name: exit $rc in $((SECONDS - start)) s"
    tail -n 40 "$log/$name.txt"
}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ $quick = 1 ]; then
    kernel_args=(--rounds 5) adapter_args=(--prompts 4 --new-tokens 32 --repeats 3) sweep_args=(--prompts 1 --tokens 2048)
    paged_args=(--rounds 3 --contexts 2048,32768) verify_args=(--rounds 3 --contexts 4096,131072)
    drafts_args=(--rounds 3 --contexts 4096,131072)
    test_args=(--ignore tests/kernels/test_triton_compile.py)  # every architecture's compile: proven on the CPU
else
    kernel_args=(--rounds 11) adapter_args=() sweep_args=() test_args=() paged_args=() verify_args=() drafts_args=()
fi
workers=()
"$PY" -c "import xdist" 2>/dev/null && workers=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))" --dist loadfile)
# The kernels' figures first (the contiguous call's, then the paged one's), so that a run cut short still returns them,
# then their correctness; --quick leaves out the compile matrix (the CPU proves it for every architecture) and the
# memory benchmark.
part "kernels" "the Triton call, GPU only, <= 1.10x flash SDPA at B 1 and 8, L 2K to 128K; host time per call <= 40 us" \
    "$PY" benchmarks/bench_kernels.py --device cuda "${kernel_args[@]}"
part "paged-kernel" "first measure: the paged Triton call (block table, vLLM FlashAttention layout) beside flash decoding and the contiguous call over the same keys, GPU and host time; its A equal to the baseline's within bf16 rounding" \
    "$PY" benchmarks/bench_paged_kernel.py "${paged_args[@]}"
part "paged-verify" "alspec-vllm's CUDA verifier (A~ in place from vLLM's NHD and HND caches, d, n, decision, commit) beside flash decoding of A over the same cache, 8B shape, bf16, 4K-128K; A~ equal to the float64 reference within bf16 rounding" \
    "$PY" benchmarks/bench_paged_verify.py "${verify_args[@]}"
part "paged-drafts" "first measure: one layer's verification per draft through the verifier the engine chooses (Triton for drafts by position, the gathered path for drafts by content), wall time beside flash decoding; kvpress's presses need kvpress installed" \
    "$PY" benchmarks/bench_paged_drafts.py "${drafts_args[@]}"
part "tests" "tests/gpu and tests/kernels pass on CUDA (bf16 checked against the reference here only)" \
    "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" "${test_args[@]}" tests/gpu tests/kernels
part "adapter" "alspec/hf wall <= 1.10 with kernel=auto and <= 1.25 with kernel=model at batch 1 and 8 (8B shape, bf16)" \
    "$PY" benchmarks/bench_adapter.py --device cuda --shape llama3-8b --batch-sizes 1,8 --kernels auto,model "${adapter_args[@]}"
part "sweep" "a shared-prefill sweep of baseline + 5 lambdas: the same generations as separate runs, faster" \
    "$PY" benchmarks/bench_sweep.py --device cuda --shape llama3-8b "${sweep_args[@]}"
if "$PY" -c "import vllm" 2>/dev/null; then  # an alspec-vllm slice where vLLM is installed
    for backend in FLASH_ATTN TRITON_ATTN; do
        part "vllm-$backend" "alspec-vllm on $backend: the newest key read back at every step; its wall over plain vLLM" \
            env ALSPEC_VLLM_CHECK_LAYOUT=1 "$PY" benchmarks/bench_vllm.py --skip engines --dtype bfloat16 --graphs \
            --attention-backend "$backend" --prompts 8 --tokens 2048 --new 64 --rounds 3
    done
fi
if [ $quick = 0 ]; then
    part "compile-matrix" "every shape fits this GPU's architecture" \
        "$PY" -m alspec_eval.kernels.triton_launch --arch "$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(10 * m + n)")"
    part "memory" "rolling-scoring peak memory <= 1.10x hf (8K tokens, 8B shape)" \
        "$PY" benchmarks/bench_memory.py --device cuda --shape llama3-8b --runs hf_rolling,alspec_rolling --repeats 1
fi
echo "[gpu_check] wrote $out"
exit $status
