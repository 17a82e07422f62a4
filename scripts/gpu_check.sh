#!/usr/bin/env bash
# The one prepared check a lent GPU machine runs (device time is scarce, so everything is here):
# GPU-marked tests into $OUT/gpu_tests.log, then the GPU benchmarks into $OUT/bench.log.
# Runs benchmarks even when tests fail, and exits with the first failure's status.
set -euo pipefail

: "${OUT:?OUT must name the folder whose files come back}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=.
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"  # seconds per benchmark, so one hang cannot eat the lease

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
python3 -c 'import cupy; print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion())'

status=0
echo "== gpu tests"
# The files holding gpu tests, named: the image has no hypothesis, which other test modules
# import, and a collection error would stop the whole run.
python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/runtime/test_cuda.py \
    tests/runtime/test_kernels_cuda.py tests/runtime/test_executor.py 2>&1 | tee "$OUT/gpu_tests.log" || status=$?

echo "== benchmarks"
: >"$OUT/bench.log"
# Only what measures the GPU: device time is scarce (host_launch.py times the CPU backend).
benches=(
    "benchmarks/fusion.py --backend cuda --repeat 20 --m 1 8"
    "benchmarks/blocks.py --backend cuda --repeat 20"
    "benchmarks/runtime.py --repeat 200"
)
for bench in "${benches[@]}"; do
    echo "== $bench" | tee -a "$OUT/bench.log"
    rc=0
    # shellcheck disable=SC2086  # the entries are command lines
    timeout "$BENCH_TIMEOUT" python3 $bench 2>&1 | tee -a "$OUT/bench.log" || rc=$?
    if ((rc != 0)); then
        echo "!! $bench exited with $rc" | tee -a "$OUT/bench.log"
        ((status == 0)) && status=$rc
    fi
done

exit "$status"
