#!/usr/bin/env bash
# The GPU checks and figures, in one call on a machine with an NVIDIA GPU, inside ~9.5 minutes
# (TOTAL_S, default 560 s: a 10-minute device call less its transfers), in order of value so
# that running out of time loses the least. The order puts first what no run has measured
# yet. The H200 run of 2026-11-30 (docs/benchmarks.md#gpu-seeds) measured the daemon, the 8B
# in int4, fp8 and bf16 (~3.5, ~2.3 and ~1.5 minutes) and the quantized linears per call
# (~45 s); the int4 and fp8 kernels then changed for its findings, proven on the CPU alone:
#   1. benchmarks/quant_gpu_kernels.py: the new int4 variants (gemv, dequant) against the old
#      rule (triton-int4-dot) and tinygemm, fp8 through _scaled_mm and through our W8A16
#      kernel, each checked against its reference;
#   2. benchmarks/gpu_step_profile.py: where a batch-1 and a batch-32 decode step of the ~1.1B
#      go (kernels, the gaps between them, host), for the distance to the bandwidth limit;
#   3. the gpu-marked tests, the quantized kernels' first (the new variants compiled);
#   4. benchmarks/gpu_seeds.py on the Llama-3-8B shape with int4, then fp8 weights, then bf16
#      (the baseline of their ratios in the same call);
#   5. benchmarks/gpu_daemon.py: the daemon with the sampler on (NVML rows, the rollup's cost);
#   6. gpu_seeds on the ~1.1B (1b shape);
#   7. the Triton attention tests compiled for the GPU (the cases the CPU suite interprets);
#   8. benchmarks/gpu_decode.py (arguments to this script go to it).
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
# The quantized kernels per call against bf16 (its table in the log: no file of its own).
step quant_gpu_kernels 150 python3 -m benchmarks.quant_gpu_kernels --rows 1,4,16,64,256
# Where a decode step of the ~1.1B goes: kernels, gaps, host (its table in the log).
step step_profile 100 python3 -m benchmarks.gpu_step_profile --shape 1b
step pytest_gpu "${TEST_TIMEOUT:-150}" bash -c 'python3 -m pytest -p no:cacheprovider -q -m gpu \
    tests/engine/test_triton_linear.py tests/engine/test_fp8_weights.py \
    tests/engine/test_quant_gpu.py tests/engine/test_transfer.py tests/engine/test_cuda_graphs.py \
    2>&1 | tee "$1"' _ "$OUT/pytest_gpu.log"
step seeds_8b_int4 220 python3 -m benchmarks.gpu_seeds --shape 8b --weights int4 \
    --budget-s 205 --json "$OUT/seeds_8b_int4.json"
step seeds_8b_fp8 200 python3 -m benchmarks.gpu_seeds --shape 8b --weights fp8 \
    --budget-s 185 --json "$OUT/seeds_8b_fp8.json"
step seeds_8b_bf16 150 python3 -m benchmarks.gpu_seeds --shape 8b --weights bf16 \
    --budget-s 140 --json "$OUT/seeds_8b_bf16.json"
step daemon 130 python3 -m benchmarks.gpu_daemon --shape 1b --json "$OUT/daemon.json"
step seeds_1b_bf16 90 python3 -m benchmarks.gpu_seeds --shape 1b --weights bf16 \
    --budget-s 80 --json "$OUT/seeds_1b_bf16.json"
step pytest_triton 240 python3 -m pytest -p no:cacheprovider -q -m "not drill" \
    tests/engine/test_triton_attention.py
step gpu_decode "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.gpu_decode \
    --json "$OUT/gpu_decode.json" "$@"
echo "== done at ${SECONDS} s of ${TOTAL_S} s" | tee -a "$LOG"
