"""The GPU codec's kernels on the CPU: a `runtime` for uzip_serve.kernels.cuda.CudaCodec that
runs cuda_codec.cu through the SIMT emulator (simt_host.h) on host memory.

    codec = CudaCodec(runtime=SimRuntime())
    codec.compress_device(cpu_tensor, cpu_uint8_out)   # the GPU encoder, bit for bit

Tensors are CPU tensors; everything else (argument plumbing, scratch, launch sequence) is the
production launcher's.
"""

from __future__ import annotations

from pathlib import Path

from simt.build import build

KERNELS = Path(__file__).resolve().parents[2] / "uzip_serve" / "kernels" / "cuda_codec.cu"


class SimRuntime:
    """Launches cuda_codec.cu's kernels in the emulator; `concurrent_blocks` CUDA blocks at once
    (their threads interleaved), so the encoder's look-back between blocks really waits;
    `reverse_blocks` starts them from the last blockIdx, so tickets and blockIdx disagree."""

    def __init__(self, concurrent_blocks: int = 3, sm_count: int = 4, reverse_blocks: bool = False):
        self._mod = build(KERNELS, name="uzsim_codec")
        self._concurrent = concurrent_blocks
        self._reverse = reverse_blocks
        self._sms = sm_count

    def launch(self, device, name: str, grid: int, block: int, args: tuple, stream, smem: int = 0) -> None:
        self._mod.configure(concurrent_blocks=self._concurrent, reverse_blocks=self._reverse)
        self._mod.launch(name, grid, block, smem, tuple(int(a) for a in args))

    def sm_count(self, device) -> int:
        return self._sms
