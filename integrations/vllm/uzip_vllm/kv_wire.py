"""The KV connector's control messages: fixed little-endian structs, never pickles.

Both sides of a transfer speak this (`kv_connector.py` builds and checks the messages; the
layers themselves go through uzip_serve.p2p's wire protocol). Kept apart from the connector so the
format sits in one place and reads without vLLM; docs/kv_connector.md describes the exchange.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import torch

XFER_ID = re.compile(r"^[0-9a-f]{32}$")

# Sender -> receiver, 68 bytes, little-endian. The first message of a connection is a probe or a
# session hello, answered with a reply; a session then carries any number of transfers, one after
# another, each a transfer hello (not answered: its layers follow at once) and its layers.
#   4s  magic "UZKV"
#   u16 version (3; 2 had no reply flags and always sent every block, 1 opened a connection per
#       transfer and answered its hello)
#   u16 kind: 1 = probe (start-up layout check; the sender closes after the reply),
#             2 = transfer (on a session only), 3 = session (a kept-open connection for transfers)
#   u16 tp_size, u16 tp_rank of the sender
#   u16 num_layers: per-layer messages that follow a transfer, in layer order
#   u8  dtype code (DTYPES), u8 reserved (0)
#   u32 block_size: tokens per KV block
#   u32 num_tokens: prompt tokens whose KV the blocks hold (prompt length - 1)
#   u32 num_blocks: blocks per layer message (ceil(num_tokens / block_size))
#   u64 page_nbytes: bytes of one block of one layer
#   32s xfer_id: ASCII hex (zeros for a probe)
# Then, for a transfer, num_layers p2p tensor messages, each {"<layer index>": [n, *page]}: the
# layer's last n of its num_blocks blocks. n = num_blocks, except for a sliding-window layer when
# the decode side allowed trimming (reply flag WINDOW_TRIM): then n may be as small as
# num_blocks - window_first_block(num_tokens, window, block_size), the blocks its attention
# can still read.
HELLO = struct.Struct("<4sHHHHHBBIIIQ32s")
HELLO_MAGIC = b"UZKV"
HELLO_VERSION = 3
KIND_PROBE, KIND_TRANSFER, KIND_SESSION = 1, 2, 3
# Receiver -> sender, the answer to a probe or session hello: 4s magic "UZKA", u32 status (0 ok, 1 refused),
# u32 flags, then a UTF-8 reason (at most 1 KiB) when refused.
REPLY = struct.Struct("<4sII")
REPLY_MAGIC = b"UZKA"
# The decode side accepts sliding-window layers without the blocks their window no longer covers.
# It allows this only with prefix caching off: a cached block must hold every layer's KV, since a
# later request that hits it may reach back further than this one's window did.
REPLY_WINDOW_TRIM = 1
DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.uint8: 4, torch.int8: 5}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES[torch.float8_e4m3fn] = 6
assert HELLO.size == 68


@dataclasses.dataclass(frozen=True)
class Hello:
    kind: int
    tp_size: int
    tp_rank: int
    num_layers: int
    dtype_code: int
    block_size: int
    num_tokens: int
    num_blocks: int
    page_nbytes: int
    xfer_id: str

    def pack(self) -> bytes:
        return HELLO.pack(HELLO_MAGIC, HELLO_VERSION, self.kind, self.tp_size, self.tp_rank, self.num_layers,
                          self.dtype_code, 0, self.block_size, self.num_tokens, self.num_blocks,
                          self.page_nbytes, self.xfer_id.encode("ascii").ljust(32, b"\0"))

    @classmethod
    def unpack(cls, data: bytes) -> "Hello":
        if len(data) != HELLO.size:
            raise ValueError(f"hello is {len(data)} bytes, expected {HELLO.size}")
        (magic, version, kind, tp_size, tp_rank, num_layers, dtype_code, _, block_size, num_tokens, num_blocks,
         page_nbytes, xfer) = HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        if version != HELLO_VERSION:
            raise ValueError(f"unsupported version {version} (this side speaks {HELLO_VERSION})")
        if kind not in (KIND_PROBE, KIND_TRANSFER, KIND_SESSION):
            raise ValueError(f"unknown kind {kind}")
        xfer_id = xfer.rstrip(b"\0").decode("ascii", "replace")
        if kind == KIND_TRANSFER and not XFER_ID.match(xfer_id):
            raise ValueError("malformed xfer id")
        return cls(kind, tp_size, tp_rank, num_layers, dtype_code, block_size, num_tokens, num_blocks,
                   page_nbytes, xfer_id)


def pack_reply(reason: str | None, flags: int = 0) -> bytes:
    return REPLY.pack(REPLY_MAGIC, 0 if reason is None else 1, flags) + (reason or "").encode()[:1024]


def unpack_reply(data: bytes) -> tuple[str | None, int]:
    """(the refusal's reason or None, flags)"""
    if len(data) < REPLY.size:
        raise ValueError("short reply")
    magic, status, flags = REPLY.unpack_from(data)
    if magic != REPLY_MAGIC:
        raise ValueError(f"bad reply magic {magic!r}")
    return (None if status == 0 else data[REPLY.size:].decode("utf-8", "replace") or "refused"), flags


def window_first_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first of a transfer's blocks that a layer with this sliding window can still read.

    Decode computes the last prompt token (position num_tokens) and then later ones; a sliding-
    window layer at position q attends to the keys q - window + 1 .. q (vLLM's convention; one
    more if a backend counts the window without q). So keys before num_tokens - window are never
    read again, and every block before the one holding that position may stay behind."""
    if not window or window <= 0:
        return 0
    return max(0, num_tokens - window) // block_size


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"UzipConnector: KV cache dtype {dtype} is not supported ({list(DTYPES)})")
    return DTYPES[dtype]
