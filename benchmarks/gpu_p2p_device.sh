#!/bin/bash
# One device call for issue 11 (docs/gpu_p2p.md): installs the carried ucxx wheels, builds the
# C codec, runs the benchmark and the GPU tests; with PROTO=1 first checks which UCX protocol
# the CUDA route uses, with DIAG=1 first times each message of our transfers and tries the
# other progress modes. Everything lands in $OUT (at most 8 files come back).
# Run with carry [".whl_ucxx"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl_ucxx/*.whl > "$OUT/setup.log" 2>&1 || { echo "install failed"; cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 setup.py build_ext --inplace -q >> "$OUT/setup.log" 2>&1 || { echo "build failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv >> "$OUT/setup.log" 2>&1
ONLY_OURS="compressed CPU reference plain chunk"
if [ -n "$PROTO" ]; then  # which protocol UCX picks for the CUDA route (one 256 MiB raw run)
    UCX_PROTO_INFO=y timeout 60 python3 -m benchmarks.gpu_p2p --sizes-mib 256 --out /tmp/proto \
        --skip adaptive IPC $ONLY_OURS > "$OUT/proto.log" 2>&1
    grep -iE "cuda_ipc|GB/s" "$OUT/proto.log" | sort | uniq -c | sort -rn | head -8
fi
if [ -n "$DIAG" ]; then
    { timeout 100 python3 -m benchmarks.gpu_p2p --trace --out /tmp/diag --skip adaptive $ONLY_OURS
      for mode in polling thread; do
          timeout 50 python3 -m benchmarks.gpu_p2p --progress $mode --out /tmp/diag_$mode --skip adaptive IPC $ONLY_OURS
      done; } 2>&1 | grep -E "GB/s|timeline" | tee "$OUT/diag.log"
fi
timeout ${BENCH_S:-280} python3 -m benchmarks.gpu_p2p --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | grep -v "^  "
echo "bench rc=$?"
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_p2p.py tests/test_codec_gpu.py \
    2>&1 | tee "$OUT/tests.log" | tail -6
echo "tests rc=$?"
