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
import hashlib
import struct
from collections.abc import Sequence

from uzip_serve import format as fmt
from uzip_serve.p2p.errors import ProtocolError

MAGIC = b"UZT1"
PROTOCOL_VERSION = 1

MSG_TENSORS = 1  # a transfer of named tensors follows

# Transfer flags (docs/gpu_p2p.md). Each offers a GPU route that the receiver answers with
# an ACK-sized reply before anything else; ACK_IPC_REFUSED moves on to the next step.
# FLAG_CUDA_UCX: a CUDA route offer (below) follows the manifest; on ACK_OK every tensor
#   travels as UCX messages straight from the sender's GPU memory into the receiver's.
# FLAG_CUDA_UCX_EAGER (only with FLAG_CUDA_UCX): the payload follows the offer at once, no
#   go-ahead is awaited. A sender sets it only after this receiver answered an earlier offer
#   ACK_OK with ACK_STANDING; the receiver then takes the payload whatever its destination.
# FLAG_CUDA_IPC: an IPC offer (below) follows (after the refused CUDA route offer, if both).
# Neither accepted: the ordinary chunk stream.
FLAG_CUDA_IPC = 1
FLAG_CUDA_UCX = 2
FLAG_CUDA_UCX_EAGER = 4
KNOWN_FLAGS = FLAG_CUDA_IPC | FLAG_CUDA_UCX | FLAG_CUDA_UCX_EAGER

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
# Reply to a route offer (IPC or CUDA route) only: this receiver will not take that route
# (another host, no CUDA, a host destination...); the sender goes on with the next step.
# The reply's second field is ACK_REFUSED_FOR_GOOD when no later transfer of this endpoint
# can take that route either, so the sender stops offering it.
ACK_IPC_REFUSED = 3
ACK_REFUSED_FOR_GOOD = 1
# Second field of ACK_OK to a CUDA route offer: a standing go-ahead. Later transfers of this
# endpoint may send the payload without asking (FLAG_CUDA_UCX_EAGER), saving a round trip.
ACK_STANDING = 2

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
        if flags & ~KNOWN_FLAGS:
            raise ProtocolError(f"unknown transfer flags 0x{flags:x}")
        if flags & FLAG_CUDA_UCX_EAGER and not flags & FLAG_CUDA_UCX:
            raise ProtocolError("an eager CUDA route payload without a CUDA route offer")
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

    @classmethod
    def unpack_expected(cls, buf, k: int, raw_nbytes: int, max_frame_nbytes: int) -> "ChunkHeader":
        """Unpacks the header of chunk k and checks it against the plan: its index, its raw
        size, and a wire size the receiver's buffer holds (a raw chunk is its raw bytes)."""
        ch = cls.unpack(buf)
        if ch.index != k or ch.raw_nbytes != raw_nbytes:
            raise ProtocolError(f"chunk {ch.index} ({ch.raw_nbytes} bytes) arrived where chunk {k} "
                                f"({raw_nbytes} bytes) was due")
        if (ch.codec == CODEC_RAW and ch.wire_nbytes != ch.raw_nbytes) or \
                (ch.codec == CODEC_UZIP and ch.wire_nbytes > max_frame_nbytes):
            raise ProtocolError(f"chunk {k}: {ch.wire_nbytes} wire bytes for {ch.raw_nbytes} raw bytes")
        return ch


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


def count_chunks(entries: Sequence[TensorEntry], chunk_bytes: int) -> int:
    """len(plan_chunks(entries, chunk_bytes)) without building the plan: the header needs
    the count, but a transfer that takes a GPU route never needs the plan, and building it
    costs microseconds a chunk in Python (0.4 ms for 1 GiB's 128 chunks on the 2-core
    development VM), on each side, per transfer."""
    count = 0
    small: dict[str, list[int]] = {}
    for e in entries:
        if e.nbytes == 0:
            continue
        if e.nbytes >= chunk_bytes // 4:
            step = chunk_bytes - chunk_bytes % e.itemsize
            count += -(-e.nbytes // step)
        else:
            small.setdefault(e.dtype, []).append(e.nbytes)
    for sizes in small.values():  # the same greedy batching as plan_chunks
        size = 0
        for n in sizes:
            if size and size + n > chunk_bytes:
                count += 1
                size = 0
            size += n
        count += 1
    return count


# ---- the CUDA IPC offer (FLAG_CUDA_IPC transfers; docs/gpu_p2p.md) ----------------------------
#
# Sent after the manifest as two messages: the fixed head (its last field sizes the body),
# then the body. Handles are opaque bytes that torch's CUDA IPC produces and consumes; they
# are parsed by length only, never unpickled.

IPC_MAGIC = b"UZI1"
IPC_MODE_WHOLE = 0  # raw: the receiver copies every tensor straight from the sender's memory
IPC_MODE_CHUNKED = 1  # per-chunk headers follow; compressed chunks are read from a staging ring
IPC_HAS_CHECKSUMS = 1  # offer flag: each tensor descriptor carries the sender's digest

# magic, mode, flags, storages, host id, device id, pid, staging storage, slots, slot bytes,
# chunk bytes (chunked mode's plan), event handle length, body bytes
IPC_OFFER_HEAD = struct.Struct("<4sIII16s16sQIIQQII")
# storage bytes, torch's storage offset, ref-counter offset, event sync required, handle
# lengths (memory, ref counter, event; 0xFFFF = none)
_IPC_STORAGE = struct.Struct("<QQQBHHH")
# storage index (NO_STORAGE for an empty tensor), byte offset in the storage, digest
_IPC_TENSOR = struct.Struct("<IQQ")
NO_STORAGE = 0xFFFFFFFF
_NONE = 0xFFFF
MAX_HANDLE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class IpcStorage:
    """One exported allocation, as torch's `UntypedStorage._share_cuda_()` describes it."""

    nbytes: int
    offset: int  # torch's storage offset inside the exported allocation
    handle: bytes
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclasses.dataclass(frozen=True)
class IpcOffer:
    mode: int
    host_id: bytes
    device_id: bytes
    pid: int
    event_handle: bytes  # an interprocess event recorded on the sender's stream after its writes
    storages: tuple[IpcStorage, ...]
    tensors: tuple[tuple[int, int, int], ...]  # (storage index, byte offset, digest) per manifest entry
    checksums: bool = False
    staging: int = NO_STORAGE  # storage index of the compressed-chunk ring (chunked mode)
    slots: int = 0
    slot_bytes: int = 0
    chunk_bytes: int = 0

    def pack(self) -> tuple[bytes, bytes]:
        def opt(b):
            return _NONE if b is None else len(b)

        parts = []
        for s in self.storages:
            parts.append(_IPC_STORAGE.pack(s.nbytes, s.offset, s.ref_counter_offset, int(s.event_sync_required),
                                           len(s.handle), opt(s.ref_counter_handle), opt(s.event_handle)))
            parts += [s.handle, s.ref_counter_handle or b"", s.event_handle or b""]
        parts += [_IPC_TENSOR.pack(*t) for t in self.tensors]
        parts.append(self.event_handle)
        body = b"".join(parts)
        head = IPC_OFFER_HEAD.pack(IPC_MAGIC, self.mode, IPC_HAS_CHECKSUMS if self.checksums else 0,
                                   len(self.storages), self.host_id, self.device_id, self.pid, self.staging,
                                   self.slots, self.slot_bytes, self.chunk_bytes, len(self.event_handle), len(body))
        return head, body

    @staticmethod
    def unpack_head(buf) -> tuple:
        """(fields..., body bytes) of the fixed head, checked for sanity before the body is received."""
        f = IPC_OFFER_HEAD.unpack(bytes(buf))
        magic, mode, flags, nstorages, *_, body_nbytes = f
        if magic != IPC_MAGIC:
            raise ProtocolError(f"not a CUDA IPC offer (magic {magic!r})")
        if mode not in (IPC_MODE_WHOLE, IPC_MODE_CHUNKED) or flags & ~IPC_HAS_CHECKSUMS:
            raise ProtocolError(f"unknown IPC offer mode {mode} / flags 0x{flags:x}")
        if body_nbytes > (64 << 20):
            raise ProtocolError(f"IPC offer body of {body_nbytes} bytes")
        return f

    @classmethod
    def unpack(cls, head_fields: tuple, body, entries: Sequence[TensorEntry]) -> "IpcOffer":
        (_, mode, flags, nstorages, host_id, device_id, pid, staging, slots, slot_bytes, chunk_bytes, ev_len,
         body_nbytes) = head_fields
        mv = memoryview(body).cast("B")
        if len(mv) != body_nbytes or nstorages > len(entries) + 1:
            raise ProtocolError("IPC offer body does not match its head")
        at, storages = 0, []

        def take(n):
            nonlocal at
            if n == _NONE:
                return None
            if n > MAX_HANDLE_BYTES or at + n > len(mv):
                raise ProtocolError("IPC offer handle runs past the offer")
            out = bytes(mv[at:at + n])
            at += n
            return out

        try:
            for _ in range(nstorages):
                nbytes, offset, rc_off, sync, hlen, rclen, evlen = _IPC_STORAGE.unpack_from(mv, at)
                at += _IPC_STORAGE.size
                if hlen == _NONE:
                    raise ProtocolError("IPC storage without a memory handle")
                storages.append(IpcStorage(nbytes, offset, take(hlen), take(rclen), rc_off, take(evlen), bool(sync)))
            tensors = []
            for e in entries:
                idx, off, digest = _IPC_TENSOR.unpack_from(mv, at)
                at += _IPC_TENSOR.size
                if idx == NO_STORAGE:
                    if e.nbytes:
                        raise ProtocolError(f"tensor {e.name!r} has no IPC storage")
                elif idx >= nstorages or off + e.nbytes > storages[idx].nbytes:
                    raise ProtocolError(f"tensor {e.name!r}: IPC descriptor outside its storage")
                tensors.append((idx, off, digest))
        except struct.error as e:
            raise ProtocolError(f"malformed IPC offer: {e}") from None
        event_handle = take(ev_len)
        if at != len(mv) or not event_handle:
            raise ProtocolError("malformed IPC offer: trailing bytes or no event handle")
        if mode == IPC_MODE_CHUNKED:
            if staging >= nstorages or slots < 1 or slots * slot_bytes > storages[staging].nbytes:
                raise ProtocolError("IPC offer: staging ring outside its storage")
            if chunk_bytes < 4096 or chunk_bytes % 64:
                raise ProtocolError(f"IPC offer: invalid chunk size {chunk_bytes}")
        return cls(mode, host_id, device_id, pid, event_handle, tuple(storages), tuple(tensors),
                   bool(flags & IPC_HAS_CHECKSUMS), staging, slots, slot_bytes, chunk_bytes)


# ---- the UCX CUDA route (FLAG_CUDA_UCX transfers; docs/gpu_p2p.md) ---------------------------
#
# One message after the manifest: the fixed head, then one u64 digest per manifest entry
# (zeros unless the checksum flag is set), so its size follows from the manifest. On ACK_OK
# (or at once, eagerly) the payload is UCX messages in the order of plan_cuda_messages, on
# the tag payload_tag(transfer id, manifest), then the final ACK on the endpoint's own tag.

CUDA_ROUTE_MAGIC = b"UZC1"
CUDA_ROUTE_HAS_CHECKSUMS = 1
# magic, flags, sender's host id (cuda_ipc.host_id: the route is offered within one host)
CUDA_ROUTE_HEAD = struct.Struct("<4sI16s")
_DIGEST = struct.Struct("<Q")
# Tensors of at least this many bytes travel alone, straight from and into their memory.
# Smaller ones are packed back to back (manifest order) into batches of at most
# CUDA_BATCH_BYTES: every UCX message costs a rendezvous round trip, a GPU gather does not.
CUDA_BATCH_BELOW = 1 << 20
CUDA_BATCH_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class CudaRouteOffer:
    host_id: bytes
    digests: tuple[int, ...] | None  # per manifest entry (cuda_ipc.digest), or None: not verified

    @staticmethod
    def nbytes(num_entries: int) -> int:
        return CUDA_ROUTE_HEAD.size + _DIGEST.size * num_entries

    def pack(self, num_entries: int) -> bytes:
        digests = self.digests if self.digests is not None else (0,) * num_entries
        if len(digests) != num_entries:
            raise ValueError(f"{len(digests)} digests for {num_entries} tensors")
        flags = CUDA_ROUTE_HAS_CHECKSUMS if self.digests is not None else 0
        return CUDA_ROUTE_HEAD.pack(CUDA_ROUTE_MAGIC, flags, self.host_id) + b"".join(
            _DIGEST.pack(d) for d in digests)

    @classmethod
    def unpack(cls, buf, num_entries: int) -> "CudaRouteOffer":
        mv = memoryview(buf).cast("B")
        if len(mv) != cls.nbytes(num_entries):
            raise ProtocolError(f"CUDA route offer of {len(mv)} bytes for {num_entries} tensors")
        magic, flags, host_id = CUDA_ROUTE_HEAD.unpack_from(mv, 0)
        if magic != CUDA_ROUTE_MAGIC:
            raise ProtocolError(f"not a CUDA route offer (magic {magic!r})")
        if flags & ~CUDA_ROUTE_HAS_CHECKSUMS:
            raise ProtocolError(f"unknown CUDA route offer flags 0x{flags:x}")
        digests = None
        if flags & CUDA_ROUTE_HAS_CHECKSUMS:
            digests = tuple(_DIGEST.unpack_from(mv, CUDA_ROUTE_HEAD.size + _DIGEST.size * i)[0]
                            for i in range(num_entries))
        return cls(host_id, digests)


def payload_tag(transfer_id: int, manifest: bytes) -> int:
    """The UCX tag of a CUDA route payload: the transfer header's id (per endpoint and
    direction, only growing) and the manifest's bytes. A receiver that expects a layout
    posts its receives on this tag before the header arrives; they match only the transfer
    they were meant for, never a later one or another layout. An int: ucxx hashes user
    tags with hash(), which is salted per process for bytes, not for ints."""
    digest = hashlib.blake2b(transfer_id.to_bytes(8, "little") + bytes(manifest), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2^63: hash() of it is the value itself


def plan_cuda_messages(entries: Sequence[TensorEntry]) -> list[tuple[int, ...]]:
    """The UCX messages of a CUDA route transfer, as tuples of manifest indices (one index:
    that tensor's bytes; several: their bytes back to back). Sender and receiver both call it."""
    messages: list[tuple[int, ...]] = []
    batch: list[int] = []
    size = 0
    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        if e.nbytes >= CUDA_BATCH_BELOW:
            messages.append((i,))
            continue
        if batch and size + e.nbytes > CUDA_BATCH_BYTES:
            messages.append(tuple(batch))
            batch, size = [], 0
        batch.append(i)
        size += e.nbytes
    if batch:
        messages.append(tuple(batch))
    return messages
