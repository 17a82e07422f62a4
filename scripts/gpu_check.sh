#!/usr/bin/env bash
# The one prepared check a lent GPU machine runs (device time is scarce, so everything is here),
# in order of what matters most, each stage under its own time limit (seconds, overridable):
#   1. every `gpu` test (cuda backend vs the interpreter and the goldens, every format,
#      graph capture, DLPack, the CuPy pool)                     -> $OUT/gpu_tests.log
#      (the GEMM family's included: cuda vs host vs the interpreter for every format and fusion,
#      and the PTX mma.sync / ldmatrix / cp.async against their host emulation on the same inputs;
#      and NCCL's all_reduce / all_gather recorded in a CUDA graph with a kernel, on a
#      communicator of one rank: tests/runtime/test_collective_capture.py. No --tp 2 stage:
#      NCCL refuses two ranks on one device, and the lent machine has one GPU)
#   2. benchmarks/llama_shapes.py: every format at Llama-3-8B shapes, fused vs unfused vs
#      cuBLAS f16, against measured copy bandwidth                -> $OUT/bench.log, llama.json
#   3. the M sweep (1 .. 4096) of the GEMV/GEMM families over the layer's projections and
#      8192 x 8192, five formats: us, GB/s, % of copy, TFLOP/s, x cuBLAS -> llama.sweep.json
#   4. benchmarks/runtime.py: plain launches vs graph replay, CPU us per block -> $OUT/bench.log
#      benchmarks/sampling.py: the sample kernel vs the logits copied to the host -> $OUT/bench.log
#      benchmarks/layer_decode.py: a Llama-3-8B layer's decode step fused vs its sub-blocks,
#      a 32-layer model's tokens/s and launches per token        -> $OUT/bench.log
#      benchmarks/moe.py: a MoE layer at Qwen3-30B-A3B and gpt-oss-20b shapes, decode (chosen
#      experts vs every expert: bytes, time) and prefill (grouped vs per expert) -> $OUT/bench.log
#   5. compute-sanitizer racecheck and memcheck over one fused block of each format family
#                                                                 -> $OUT/sanitizer.log
# Worst case about 9.3 minutes with the default limits; typically far less. Call the device with
# timeout_s 590 and read $OUT/summary.txt first; llama.json is written row by row, so a stage
# that times out still leaves what it measured. Every stage runs even when an earlier
# one failed; the exit status is the first failure's.
#
# scripts/gpu_check.sh --dry-run: the same stages with no GPU, so a broken one is found before a
# lease is spent: stage 1 collects the gpu tests (a module that cannot be imported is an error),
# each benchmark runs its command on the host backend at a tiny size (the options appended below
# override the GPU run's: argparse keeps an option's last value), the sanitizer stages collect
# their selection (none selected is an error). `make gpu-dry-run` runs it in a virtualenv of the
# GPU machine's packages (scripts/device_image.py), and so does tests/test_gpu_check.py in CI,
# sharing the test session's compile cache (a few seconds a stage; minutes on a cold cache,
# mostly g++). OUT defaults to a temporary folder.
# Both modes: PYTHON (default python3) runs everything; STAGES="llama_shapes,moe" runs only the
# stages whose names it lists (the device info is always printed); GPU_TESTS (default tests)
# is what stage 1 runs.
set -uo pipefail

DRY=
[[ ${1:-} == --dry-run ]] && DRY=1
((DRY)) && : "${OUT:=$(mktemp -d)}"
: "${OUT:?OUT must name the folder whose files come back}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
# CI's skip policy (tests/skip_policy.py) is not the GPU machine's: there the test modules of
# what its image lacks skip, and a dry run from `make test` must see them skip too.
unset QIR_CI
# Every stage's processes (and stage 1's 8 workers, each collecting the whole suite) reuse the
# bytecode the first one compiled, as the Makefile lets them (8 s of a collection here).
unset PYTHONDONTWRITEBYTECODE
PYTHON="${PYTHON:-python3}" STAGES="${STAGES:-}" GPU_TESTS="${GPU_TESTS:-tests}"
# A dry run's limits only catch a hang; its host kernels build at -O1 without the unroll
# pragmas, as the tests' do.
((DRY)) && export QIR_HOST_OPT="${QIR_HOST_OPT:-1}" QIR_HOST_UNROLL="${QIR_HOST_UNROLL:-0}" T_DEFAULT=300
T_TESTS="${T_TESTS:-${T_DEFAULT:-180}}" T_LLAMA="${T_LLAMA:-${T_DEFAULT:-90}}"
T_SWEEP="${T_SWEEP:-${T_DEFAULT:-120}}" T_RUNTIME="${T_RUNTIME:-${T_DEFAULT:-30}}"
T_LAYER="${T_LAYER:-${T_DEFAULT:-45}}" T_SANITIZER="${T_SANITIZER:-${T_DEFAULT:-30}}"
T_SAMPLING="${T_SAMPLING:-${T_DEFAULT:-20}}" T_MOE="${T_MOE:-${T_DEFAULT:-60}}"
status=0
summary="$OUT/summary.txt"
: >"$summary"

stage() {  # stage NAME LIMIT LOG COMMAND...: run, append to LOG, record the outcome
    local name=$1 limit=$2 log=$3 rc=0 t0=$SECONDS
    shift 3
    [[ -z $STAGES || ",$STAGES," == *",$name,"* ]] || return 0
    echo "== $name: $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log" || rc=$?
    local took=$((SECONDS - t0))
    if ((rc == 124)); then
        echo "$name: TIMED OUT after ${limit}s" | tee -a "$summary"
    else
        echo "$name: exit $rc in ${took}s" | tee -a "$summary"
    fi
    ((rc != 0 && status == 0)) && status=$rc
    return 0
}

{
    echo "== device${DRY:+ (dry run: no GPU)}"
    ((DRY)) || nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
    "$PYTHON" - <<'EOF'
from qir.runtime import nvrtc
from qir.runtime.toolkit import cuda_include_dirs

try:
    import cupy

    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion())
except ImportError as e:
    print("cupy: cannot import:", e)
if nvrtc.available():
    import cuda.core

    print("compiles with cuda.core", cuda.core.__version__, "nvrtc", nvrtc.nvrtc_version())
else:
    print("compiles with cupy.RawModule (no usable cuda-core)")
print("CUDA headers:", [str(p) for p in cuda_include_dirs()] or "NOT FOUND")
EOF
} 2>&1 | tee "$OUT/device.txt"

# -n 8: NVRTC compiles dominate and run on the CPU; each worker has its own compile cache, and
# compiles on 2 threads (8 x 2 = the 16 cores; the default, all cores, would oversubscribe).
# shellcheck disable=SC2086  # GPU_TESTS: paths
stage "gpu tests" "$T_TESTS" "$OUT/gpu_tests.log" \
    env QIR_COMPILE_JOBS=2 "$PYTHON" -m pytest -m gpu -q -rfEs -p no:cacheprovider -n 8 $GPU_TESTS \
    ${DRY:+--collect-only -n 0}

# The dry run's sizes are those of tests/test_benchmarks.py, whose kernels it then finds in the
# compile cache when the two share one (the test suite's).
stage "llama_shapes" "$T_LLAMA" "$OUT/bench.log" \
    "$PYTHON" benchmarks/llama_shapes.py --backend cuda --m 1 8 --json "$OUT/llama.json" \
    ${DRY:+--backend host --m 1 --repeat 1 --formats ct4g128bf16}

# Rows are written as they are measured: a timeout keeps the sweep so far.
stage "M sweep" "$T_SWEEP" "$OUT/bench.log" \
    "$PYTHON" benchmarks/llama_shapes.py --backend cuda --no-blocks --sweep --repeat 7 --inner 10 \
    --formats mlx4g64bf16 awq4g128 nvfp4mul nvfp4mula4 fp8ch --json "$OUT/llama.json" \
    ${DRY:+--backend host --formats mlx4g64bf16 --shapes o --sweep-m 1 4096 --repeat 1 --inner 1}

stage "runtime" "$T_RUNTIME" "$OUT/bench.log" "$PYTHON" benchmarks/runtime.py --repeat 200 \
    ${DRY:+--blocks qkv --repeat 3}

stage "layer_decode" "$T_LAYER" "$OUT/bench.log" \
    "$PYTHON" benchmarks/layer_decode.py --backend cuda --layers 32 \
    ${DRY:+--backend host --scale 0.03125 --repeat 1 --layers 1 --position 40 --max-seq 64}

# The sample kernel against copying the logits to the host and drawing there (32k, 152k ids).
stage "sampling" "$T_SAMPLING" "$OUT/bench.log" "$PYTHON" benchmarks/sampling.py --backend cuda \
    ${DRY:+--backend host --vocab 300 --repeat 1}

# A MoE layer: the chosen experts' GEMVs against every expert's rows, grouped GEMM at prefill.
stage "moe" "$T_MOE" "$OUT/bench.log" "$PYTHON" benchmarks/moe.py --backend cuda \
    ${DRY:+--backend host --models gpt-oss-20b --experts 8 --scale 0.04 --prefill 24 --repeat 1}

# One block of each kernel family: the sanitizers slow kernels by 10-100x. What they can see:
# racecheck, shared memory (in these kernels: quantize_act's block reduction); memcheck, accesses
# outside any allocation (an overrun from one arena value into the next stays invisible; the
# interpreter comparisons catch those).
families="cuda and (mlx3g64bf16 or awq4g64 or gptq3g128actf16 or ct4g32bf16 or fp8ch or mxfp4 \
or nvfp4diva4 or densebf16)"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
tools=(racecheck memcheck)
((DRY)) && tools=(racecheck)  # both would collect the same tests
for tool in "${tools[@]}"; do
    under=("$sanitizer" --tool "$tool" --error-exitcode 3)
    ((DRY)) && under=()
    stage "compute-sanitizer $tool" "$T_SANITIZER" "$OUT/sanitizer.log" "${under[@]}" \
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/runtime/test_every_format.py \
        -k "$families" ${DRY:+--collect-only}
done

echo "== summary"
cat "$summary"
exit "$status"
