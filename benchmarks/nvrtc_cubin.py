"""Compile uzip_serve/kernels/cuda_codec.cu to an sm_90 cubin with NVRTC, on a machine without
a GPU, and print ptxas's register and spill report per kernel.

Device time is scarce: compiling here and carrying the cubin saves the NVRTC compile of every
fresh GPU machine (21 s for format v2's kernels; point UZIP_CUDA_CUBIN at it there; cuda.py
loads it instead of the source). Where nvcc is installed, `nvcc -arch=sm_90 -O3 -std=c++17
--cubin` makes the same kind of cubin (the -DUZ_PHASES build of docs/gpu.md is made that way). libnvrtc comes from the `nvidia-cuda-nvrtc` wheel (`pip download --no-deps
nvidia-cuda-nvrtc`, unzip), e.g.:

    python -m benchmarks.nvrtc_cubin --nvrtc x/nvidia/cu13/lib/libnvrtc.so.13 --out .gpudata/codec.cubin
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "uzip_serve" / "kernels" / "cuda_codec.cu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True, help="path to libnvrtc.so")
    ap.add_argument("--out", help="write the cubin here")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", action="append", default=[], help="extra defines, e.g. -D UZ_PHASES")
    ap.add_argument("--lineinfo", action="store_true",
                    help="keep source lines, for `nvdisasm -g` (the nvidia-cuda-nvdisasm wheel): SASS per line")
    args = ap.parse_args(argv)
    lib = ctypes.CDLL(args.nvrtc)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), SRC.read_bytes(), b"cuda_codec.cu", 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    # the options cuda.py compiles with, plus the target and ptxas's report
    opts = [b"-std=c++17", f"-arch={args.arch}".encode(), b"--ptxas-options=-v"]
    opts += [f"-D{d}".encode() for d in args.D]
    opts += [b"-lineinfo"] if args.lineinfo else []
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    keep = ("error", "warning", "Compiling entry", "registers", "spill")
    print("\n".join(line for line in log.value.decode(errors="replace").splitlines() if any(k in line for k in keep)))
    if rc:
        return 1
    if args.out:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        Path(args.out).write_bytes(buf.raw)
        print(f"wrote {args.out} ({n.value} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
