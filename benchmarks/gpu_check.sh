#!/usr/bin/env bash
# The GPU checks and figures, in one call on a machine with an NVIDIA GPU, inside ~9.5 minutes
# (TOTAL_S, default 560 s: a 10-minute device call less its transfers), in order of value so
# that running out of time loses the least. The order puts first what no run has measured yet
# (after the H200 run of 2026-11-29, docs/benchmarks.md#gpu-seeds: 8B bf16 done in 159 s, fp8's
# start-up alone took 161 s, int4 and the daemon not reached or failed, the gpu-marked tests
# finished one test in 150 s):
#   1. benchmarks/gpu_daemon.py: the daemon with the sampler on (NVML rows, the rollup's cost);
#   2. benchmarks/gpu_seeds.py on the Llama-3-8B shape with int4, then fp8 weights (the seeds'
#      table; each inside ~3.5 minutes, so their batch 64 may be cut);
#   3. gpu_seeds on the 8B in bf16 (measured once; its batch 64 replays graphs since 32d26c1,
#      where it ran eagerly at half speed before);
#   4. the gpu-marked tests (a step that never waits for the device, CUDA graphs over the
#      compiled step, the quantized kernels, ...);
#   5. gpu_seeds on the ~1.1B (1b shape); the quantized kernels per call;
#   6. the Triton attention tests compiled for the GPU (the cases the CPU suite interprets);
#   7. benchmarks/gpu_decode.py (arguments to this script go to it).
# SKIP="name ..." skips steps by name (e.g. SKIP=seeds_8b_bf16 once its figures are in).
# Each step's timeout is the smaller of its own cap and the time left; a step with under 20 s
# left is skipped (said in the log). Logs go to $OUT/gpu_check.log (one file: a device call
# brings back 8 files at most, and these are 8 with pytest_gpu.log), figures to $OUT/*.json
# (default /tmp/gpu-check). Wheels in .whl/ (for packages the machine lacks: the daemon's, see
# benchmarks/README.md) are installed to /tmp/site first.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Run from the source tree (nothing is installed there): the migrations ship as
# controlplane.migrations only through pyproject's package-dir mapping, which a plain PYTHONPATH
# lacks (the daemon check failed on it: ModuleNotFoundError, 2026-11-29). A link in this copy.
[ -e controlplane/migrations ] || ln -s ../migrations controlplane/migrations
TOTAL_S=${TOTAL_S:-560}
LOG="$OUT/gpu_check.log"
# cap N: N, or the seconds left if fewer (at least 1: `timeout 0` would mean no limit).
cap() {
    local l=$((TOTAL_S - SECONDS))
    ((l < 1)) && l=1
    if ((l < $1)); then echo "$l"; else echo "$1"; fi
}
# step NAME CAP CMD...: CMD under `timeout` (cap CAP; KILL 20 s after the TERM), its output
# appended to $LOG, its tail shown.
step() {
    local name=$1 t
    t=$(cap "$2")
    shift 2
    if [[ " ${SKIP:-} " == *" $name "* ]]; then
        echo "== $name: skipped (SKIP)" | tee -a "$LOG"
        return 0
    fi
    if ((t < 20)); then
        echo "== $name: skipped, ${t} s left of ${TOTAL_S} s" | tee -a "$LOG"
        return 0
    fi
    echo "== $name: timeout ${t} s, at ${SECONDS} s" | tee -a "$LOG"
    timeout -k 20 "$t" "$@" 2>&1 | tee -a "$LOG" | tail -25
    echo "== $name: exit ${PIPESTATUS[0]} at ${SECONDS} s" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step daemon 130 python3 -m benchmarks.gpu_daemon --shape 1b --json "$OUT/daemon.json"
step seeds_8b_int4 220 python3 -m benchmarks.gpu_seeds --shape 8b --weights int4 \
    --budget-s 205 --json "$OUT/seeds_8b_int4.json"
step seeds_8b_fp8 220 python3 -m benchmarks.gpu_seeds --shape 8b --weights fp8 \
    --budget-s 205 --json "$OUT/seeds_8b_fp8.json"
step seeds_8b_bf16 270 python3 -m benchmarks.gpu_seeds --shape 8b --weights bf16 \
    --budget-s 240 --json "$OUT/seeds_8b_bf16.json"
step pytest_gpu "${TEST_TIMEOUT:-150}" bash -c 'python3 -m pytest -p no:cacheprovider -q -m gpu \
    tests/engine/test_transfer.py tests/engine/test_cuda_graphs.py tests/engine/test_quant_gpu.py \
    tests/engine/test_fp8_weights.py tests/engine/test_triton_linear.py 2>&1 | tee "$1"' _ \
    "$OUT/pytest_gpu.log"
step seeds_1b_bf16 150 python3 -m benchmarks.gpu_seeds --shape 1b --weights bf16 \
    --budget-s 120 --json "$OUT/seeds_1b_bf16.json"
# The quantized kernels per call against bf16 (its table in the log: no file of its own).
step quant_gpu_kernels 150 python3 -m benchmarks.quant_gpu_kernels
step pytest_triton 240 python3 -m pytest -p no:cacheprovider -q -m "not drill" \
    tests/engine/test_triton_attention.py
step gpu_decode "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.gpu_decode \
    --json "$OUT/gpu_decode.json" "$@"
echo "== done at ${SECONDS} s of ${TOTAL_S} s" | tee -a "$LOG"
