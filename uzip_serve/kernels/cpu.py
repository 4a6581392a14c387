"""Binding for the C CPU codec (cpu_codec.c): argument plumbing only.

The extension is compiled by the package's install step (`pip install .`, see
setup.py). Buffers go to C by pointer through the buffer protocol; the GIL is
released for the whole encode/decode, which fans out over blocks on `threads`
native threads.
"""

from __future__ import annotations

from uzip_serve.format import FrameError, FrameHeader

try:
    from uzip_serve.kernels import _cpu_codec as _c
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        "uzip_serve's C codec is not built. Install the package with `pip install -e .` "
        "(or run `make setup`), which compiles uzip_serve/kernels/cpu_codec.c."
    ) from e


class CpuCodec:
    name = "cpu"

    def __init__(self, module=None):
        # module: another build of the extension (benchmarks/codec_cpu_ab.py compares two)
        self._c = module or _c

    def compress_blocks(self, src, numel, dtype_layout, itemsize, block_elems, substream_elems, out,
                        table_offset, payload_offset, threads):
        return self._c.compress_blocks(src, dtype_layout, itemsize, numel, block_elems, substream_elems, out,
                                       table_offset, payload_offset, threads)

    def decompress_blocks(self, frame, header: FrameHeader, out, threads):
        err = self._c.decompress_blocks(frame, header.dtype.layout, header.dtype.itemsize, header.numel,
                                        header.block_elems, header.substream_elems, header.table_offset,
                                        header.payload_offset, header.flags, out, threads)
        if err is not None:
            raise FrameError(f"corrupt uzip frame: {err}")

    def uzh64(self, data) -> int:
        """UZH64, the frame checksum (docs/format.md)."""
        return self._c.uzh64(data)

    def crc32c(self, data) -> int:
        """CRC32C, the P2P raw-chunk checksum (not part of the frame format)."""
        return self._c.crc32c(data)
