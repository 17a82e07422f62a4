#!/usr/bin/env bash
# The one prepared check a lent GPU machine runs (device time is scarce, so everything is here):
# GPU-marked tests into $OUT/gpu_tests.log, then every benchmark into $OUT/bench.log.
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
python3 -m pytest -m gpu -q -rs tests 2>&1 | tee "$OUT/gpu_tests.log" || status=$?

echo "== benchmarks"
: >"$OUT/bench.log"
shopt -s nullglob
benches=(benchmarks/*.py)
if ((${#benches[@]} == 0)); then
    echo "no benchmarks/*.py yet" | tee -a "$OUT/bench.log"
fi
for bench in "${benches[@]}"; do
    args=()
    if python3 "$bench" --help 2>/dev/null | grep -q -- "--backend"; then
        args=(--backend cuda)
    fi
    echo "== $bench ${args[*]}" | tee -a "$OUT/bench.log"
    rc=0
    timeout "$BENCH_TIMEOUT" python3 "$bench" "${args[@]}" 2>&1 | tee -a "$OUT/bench.log" || rc=$?
    if ((rc != 0)); then
        echo "!! $bench exited with $rc" | tee -a "$OUT/bench.log"
        ((status == 0)) && status=$rc
    fi
done

exit "$status"
