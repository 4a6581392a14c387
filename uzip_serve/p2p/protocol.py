"""The P2P wire protocol: fixed headers, the tensor manifest and the chunk plan.

Specified in docs/p2p.md. One transfer is, in order on one endpoint::

    TransferHeader   36 bytes
    manifest         TransferHeader.manifest_nbytes bytes
    per chunk:       ChunkHeader (32 bytes), then ChunkHeader.wire_nbytes of payload

Every size is sent before the bytes it describes, because UCX never tells a sender
that the receiver's buffer was too small. Nothing is pickled: headers are fixed
structs, the manifest is a length-prefixed binary list. Both sides derive the same
chunk plan from the manifest, so chunk headers need not say where a chunk goes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from uzip_serve import format as fmt
from uzip_serve.p2p.errors import ProtocolError

MAGIC = b"UZT1"
PROTOCOL_VERSION = 1

MSG_TENSORS = 1  # a transfer of named tensors follows

# magic, version, msg type, flags, manifest bytes, chunks, chunk bytes, transfer id
TRANSFER_HEADER = struct.Struct("<4sHHIIIQQ")
# chunk index, codec, raw bytes, wire bytes, crc32c of the raw bytes (raw chunks only), reserved
CHUNK_HEADER = struct.Struct("<IIQQII")

# After the last chunk the receiver answers with an ack: status, reserved. The sender's
# send_tensors returns only on ACK_OK, so "sent" means "received whole and verified".
ACK = struct.Struct("<II")
ACK_OK = 0
ACK_CHECKSUM = 1  # a chunk failed its checksum or did not decode
ACK_PROTOCOL = 2  # the transfer broke the protocol or did not fit the destination

CODEC_RAW = 0  # payload is the raw bytes
CODEC_UZIP = 1  # payload is one uzip frame (docs/format.md) of the chunk, checksummed inside

_ENTRY_HEAD = struct.Struct("<HBBQ")  # name bytes, dtype code, ndim, nbytes
_DIM = struct.Struct("<Q")
_COUNT = struct.Struct("<I")
MAX_NAME_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int

    @property
    def itemsize(self) -> int:
        return fmt.dtype_by_name(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class TransferHeader:
    manifest_nbytes: int
    num_chunks: int
    chunk_bytes: int
    transfer_id: int
    flags: int = 0

    def pack(self) -> bytes:
        return TRANSFER_HEADER.pack(MAGIC, PROTOCOL_VERSION, MSG_TENSORS, self.flags, self.manifest_nbytes,
                                    self.num_chunks, self.chunk_bytes, self.transfer_id)

    @classmethod
    def unpack(cls, buf, *, max_manifest_bytes: int) -> "TransferHeader":
        magic, version, msg, flags, mbytes, nchunks, chunk_bytes, tid = TRANSFER_HEADER.unpack(bytes(buf))
        if magic != MAGIC:
            raise ProtocolError(f"not a uzip transfer (magic {magic!r})")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks protocol v{version}; this side speaks v{PROTOCOL_VERSION}")
        if msg != MSG_TENSORS:
            raise ProtocolError(f"unknown message type {msg}")
        if flags:
            raise ProtocolError(f"unknown transfer flags 0x{flags:x}")
        if mbytes > max_manifest_bytes:
            raise ProtocolError(f"manifest of {mbytes} bytes exceeds the limit {max_manifest_bytes}")
        if chunk_bytes < 64 or chunk_bytes % 64:
            raise ProtocolError(f"invalid chunk size {chunk_bytes}")
        return cls(mbytes, nchunks, chunk_bytes, tid, flags)


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    index: int
    codec: int
    raw_nbytes: int
    wire_nbytes: int
    crc32c: int = 0

    def pack(self) -> bytes:
        return CHUNK_HEADER.pack(self.index, self.codec, self.raw_nbytes, self.wire_nbytes, self.crc32c, 0)

    @classmethod
    def unpack(cls, buf) -> "ChunkHeader":
        index, codec, raw, wire, crc, reserved = CHUNK_HEADER.unpack(bytes(buf))
        if codec not in (CODEC_RAW, CODEC_UZIP) or reserved:
            raise ProtocolError(f"chunk {index}: unknown codec {codec}")
        return cls(index, codec, raw, wire, crc)


def encode_manifest(entries: Sequence[TensorEntry]) -> bytes:
    parts = [_COUNT.pack(len(entries))]
    for e in entries:
        name = e.name.encode()
        if len(name) > MAX_NAME_BYTES:
            raise ValueError(f"tensor name longer than {MAX_NAME_BYTES} bytes: {e.name[:40]}...")
        dt = fmt.dtype_by_name(e.dtype)
        if len(e.shape) > fmt.MAX_NDIM:
            raise ValueError(f"tensor {e.name!r} has more than {fmt.MAX_NDIM} dims")
        parts.append(_ENTRY_HEAD.pack(len(name), dt.code, len(e.shape), e.nbytes))
        parts.append(name)
        parts.extend(_DIM.pack(d) for d in e.shape)
    return b"".join(parts)


def decode_manifest(buf, *, max_tensors: int) -> list[TensorEntry]:
    """Parses a peer's manifest, checking every field against the buffer and the limits."""
    mv = memoryview(buf).cast("B")
    try:
        (count,) = _COUNT.unpack_from(mv, 0)
        if count > max_tensors:
            raise ProtocolError(f"manifest lists {count} tensors, more than the limit {max_tensors}")
        at, out, names = _COUNT.size, [], set()
        for _ in range(count):
            name_len, code, ndim, nbytes = _ENTRY_HEAD.unpack_from(mv, at)
            at += _ENTRY_HEAD.size
            if name_len > MAX_NAME_BYTES or ndim > fmt.MAX_NDIM:
                raise ProtocolError("manifest entry exceeds the name or ndim limit")
            name = bytes(mv[at:at + name_len]).decode()
            if len(name.encode()) != name_len:
                raise ProtocolError("manifest entry name runs past the manifest")
            at += name_len
            shape = tuple(_DIM.unpack_from(mv, at + _DIM.size * i)[0] for i in range(ndim))
            at += _DIM.size * ndim
            dt = fmt.DTYPES_BY_CODE.get(code)
            if dt is None:
                raise ProtocolError(f"tensor {name!r}: unknown dtype code {code}")
            numel = 1
            for d in shape:
                numel *= d
            if numel * dt.itemsize != nbytes or nbytes > fmt.MAX_DECODED_NBYTES:
                raise ProtocolError(f"tensor {name!r}: {nbytes} bytes do not match {dt.name} {shape}")
            if name in names:
                raise ProtocolError(f"tensor {name!r} appears twice in the manifest")
            names.add(name)
            out.append(TensorEntry(name, dt.name, shape, nbytes))
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed manifest: {e}") from None
    if at != len(mv):
        raise ProtocolError(f"manifest has {len(mv) - at} trailing bytes")
    return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [start, start + nbytes) of tensor `tensor` (an index into the manifest)."""

    tensor: int
    start: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def plan_chunks(entries: Sequence[TensorEntry], chunk_bytes: int) -> list[Chunk]:
    """How a transfer's bytes are cut into chunks; sender and receiver both call it.

    A tensor of at least chunk_bytes / 4 is split into slices of chunk_bytes (rounded
    down to whole elements). Smaller tensors are batched with others of the same dtype,
    in manifest order, up to chunk_bytes per chunk, so 200 small tensors cost a few
    messages, not 200. Empty tensors need no chunk.
    """
    chunks: list[Chunk] = []
    small: dict[str, list[Piece]] = {}
    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        if e.nbytes >= chunk_bytes // 4:
            step = chunk_bytes - chunk_bytes % e.itemsize
            for start in range(0, e.nbytes, step):
                chunks.append(Chunk(e.dtype, (Piece(i, start, min(step, e.nbytes - start)),)))
        else:
            small.setdefault(e.dtype, []).append(Piece(i, 0, e.nbytes))
    for dtype, pieces in small.items():
        batch, size = [], 0
        for p in pieces:
            if batch and size + p.nbytes > chunk_bytes:
                chunks.append(Chunk(dtype, tuple(batch)))
                batch, size = [], 0
            batch.append(p)
            size += p.nbytes
        if batch:
            chunks.append(Chunk(dtype, tuple(batch)))
    return chunks
