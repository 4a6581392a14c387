#!/bin/bash
# One device call for issue 11 (docs/gpu_p2p.md): installs the carried ucxx wheels, builds the
# C codec, checks which UCX protocol the CUDA route uses, runs the benchmark and the GPU tests.
# Everything lands in $OUT (at most 8 files come back). Run with carry [".whl_ucxx"].
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl_ucxx/*.whl > "$OUT/setup.log" 2>&1 || { echo "install failed"; cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 setup.py build_ext --inplace -q >> "$OUT/setup.log" 2>&1 || { echo "build failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv >> "$OUT/setup.log" 2>&1
# Which protocol UCX picks for the CUDA route (one 256 MiB raw run, UCX_PROTO_INFO on).
UCX_PROTO_INFO=y timeout 60 python3 -m benchmarks.gpu_p2p --sizes-mib 256 --out /tmp/proto \
    --skip adaptive compressed IPC CPU reference plain chunk > "$OUT/proto.log" 2>&1
echo "proto check rc=$?"
grep -iE "cuda_ipc|rendezvous|GB/s" "$OUT/proto.log" | sort | uniq -c | sort -rn | head -12
timeout ${BENCH_S:-280} python3 -m benchmarks.gpu_p2p --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^  "
echo "bench rc=$?"
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_p2p.py tests/test_codec_gpu.py \
    2>&1 | tee "$OUT/tests.log" | tail -25
echo "tests rc=$?"
