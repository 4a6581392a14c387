#!/bin/bash
# One device call for issue 3 (docs/gpu.md): installs the carried nvCOMP wheels, builds the C
# codec, compiles the kernels with NVRTC (timed), runs the GPU codec tests and the benchmark.
# Everything lands in $OUT (at most 8 files come back). Run with carry [".whl", ".gpudata"].
#   TESTS=0 skips the tests; BENCH_ARGS adds benchmark options; BENCH_S / TESTS_S: time limits.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > "$OUT/setup.log" 2>&1 || { echo "install failed"; cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 UZIP_GPU_DATA=$PWD/.gpudata/real.safetensors
python3 setup.py build_ext --inplace -q >> "$OUT/setup.log" 2>&1 || { echo "build failed"; tail "$OUT/setup.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee -a "$OUT/setup.log"
python3 - <<'PY' 2>&1 | tee -a "$OUT/setup.log"
import time, torch
from uzip_serve.kernels import get_backend
t = time.time(); get_backend("cuda").load(0); print(f"kernels compiled (NVRTC) and loaded in {time.time() - t:.1f} s")
PY
if [ "${TESTS:-1}" = 1 ]; then
    timeout ${TESTS_S:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_codec_gpu.py -k "cuda" \
        2>&1 | tee "$OUT/tests.log" | tail -15
    echo "tests rc=$?"
fi
timeout ${BENCH_S:-300} python3 -m benchmarks.codec_gpu --data .gpudata/real.safetensors --out "$OUT" $BENCH_ARGS \
    2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
