#!/usr/bin/env bash
# The GPU checks, in one call on a machine with an NVIDIA GPU: the Triton attention tests
# compiled for the GPU (the same cases the CPU suite runs under the interpreter), the
# gpu-marked tests (CUDA graphs over the compiled step, the quantized kernels), then
# benchmarks/gpu_decode.py.
# Logs and JSON go to $OUT (default /tmp/gpu-check). Wheels in .whl/ (for packages the
# machine lacks, e.g. sqlalchemy for tests/conftest.py) are installed to /tmp/site first.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -m "not drill" \
    tests/engine/test_triton_attention.py 2>&1 | tee "$OUT/pytest_triton.log" | tail -15
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -m gpu \
    tests/engine/test_cuda_graphs.py tests/engine/test_quant_gpu.py tests/engine/test_fp8_weights.py \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
timeout "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.gpu_decode --json "$OUT/gpu_decode.json" \
    "$@" 2>&1 | tee "$OUT/gpu_decode.log" | tail -20
