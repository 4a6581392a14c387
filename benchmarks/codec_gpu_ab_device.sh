#!/bin/bash
# A/B of kernel builds in one device call (METHOD.md: compare only within one run). Each
# variant is NAME=TREE:CUBIN[:VAR=VALUE,...]: a source tree (its launcher, cuda.py, must match
# the cubin; "." is the working tree, an older one is e.g. `git archive BASE uzip_serve
# benchmarks setup.py pyproject.toml tests` unpacked under .gpudata/), a cubin built by
# benchmarks/nvrtc_cubin.py, and settings for its runs (e.g. UZIP_GPU_SUBSTREAM=64 for frames
# of other sub-streams).
# Carry [".gpudata"] (and ".whl" for nvCOMP), then e.g.
#   VARIANTS="base=.gpudata/base:.gpudata/base.cubin new=.:.gpudata/new.cubin" \
#   PHASES="base=.gpudata/base:.gpudata/base_phases.cubin" bash benchmarks/codec_gpu_ab_device.sh
# Runs the GPU tests on the working tree's source (CuPy's NVRTC), then the benchmark's bf16
# N(0, 0.02) rows for every variant, twice in turn, then the phase cycles of the PHASES
# variants (-DUZ_PHASES builds). SIZES (MiB), REPEATS and PHASE_SIZES choose the rows.
set -o pipefail
ROOT=$PWD
# the nvCOMP wheels only matter to NCU and nvCOMP rows; an A/B (--no-nvcomp) runs without them
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$OUT/setup.log" 2>&1 || { echo "install failed"; cat "$OUT/setup.log"; exit 1; }
fi
export PYTHONUNBUFFERED=1 UZIP_GPU_DATA=$ROOT/.gpudata/real.safetensors
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
for tree in $(for v in $VARIANTS $PHASES; do t=${v#*=}; echo "${t%%:*}"; done | sort -u); do
    (cd "$tree" && python3 setup.py build_ext --inplace -q >> "$OUT/setup.log" 2>&1) || { echo "build failed: $tree"; exit 1; }
done
if [ "${TESTS:-1}" = 1 ]; then
    PYTHONPATH=/tmp/site:$ROOT timeout ${TESTS_S:-240} python3 -m pytest -q -x -p no:cacheprovider \
        tests/test_codec_gpu.py -k cuda 2>&1 | tee "$OUT/tests.log" | tail -4
fi
in_variant() { # NAME=TREE:CUBIN[:VAR=VALUE,...], then a command to run in TREE with that cubin
    local spec=${1#*=}; shift
    local tree=${spec%%:*} rest=${spec#*:}
    local cubin=$ROOT/${rest%%:*} vars=
    [ "$rest" != "${rest#*:}" ] && vars=${rest#*:}
    (cd "$tree" && env ${vars//,/ } PYTHONPATH=/tmp/site:$PWD UZIP_CUDA_CUBIN=$cubin "$@")
}
run() { # a variant, then benchmark arguments
    local v=$1; shift
    in_variant "$v" python3 -m benchmarks.codec_gpu --data "$ROOT/.gpudata/real.safetensors" "$@"
}
for round in 1 2; do
    for v in $VARIANTS; do
        echo "--- ${v%%=*}, round $round"
        run "$v" --no-nvcomp --only normal-bf16 --sizes "${SIZES:-1,64,1024}" --repeats "${REPEATS:-7}" \
            --out "$OUT/${v%%=*}$round" 2>&1 | grep -v "^  "
    done
done
for v in $PHASES; do
    echo "--- phases: ${v%%=*}"
    run "$v" --phases --sizes "${PHASE_SIZES:-1,1024}" --repeats 5 2>&1
done
# NCU="VARIANT ...": shared-memory bank conflicts and instructions of the bf16 kernels at
# 64 MiB (one compress and one decompress after a warm-up; Nsight Compute on the device).
for v in $NCU; do
    echo "--- ncu: ${v%%=*}"
    in_variant "$v" timeout 120 ncu --clock-control none \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
        -k regex:"uz_(enc|dec)_bf16" --launch-skip 2 --launch-count 2 python3 -m benchmarks.codec_gpu --once 64 2>&1 \
        | grep -E "uz_|duration|inst_executed|wavefronts|conflicts"
done
