"""Transport settings, with defaults chosen for a small (2-core) host."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

Compression = Literal["auto", "on", "off"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransportConfig:
    # UCX transports (UCX_TLS), set when UCX starts in this process. "auto": "tcp", plus
    # "cuda_copy,cuda_ipc" where this process sees a CUDA device, so that UCX can move GPU
    # memory itself (the CUDA route below). "tcp" works between any two hosts.
    ucx_tls: str = "auto"
    # ucxx progress mode. "blocking" drives UCX from the event loop when the socket is
    # readable: measured 3-5x faster than the default "thread" mode on a 2-core host,
    # where a busy-polling progress thread competes with the codec for the cores.
    progress_mode: Literal["blocking", "polling", "thread", "thread-polling"] = "blocking"
    # Large tensors travel in chunks of this many raw bytes; chunk k+1 is compressed
    # while chunk k is on the wire.
    chunk_bytes: int = 8 << 20
    # UCX sends messages up to this many bytes eagerly (its RNDV_THRESH), set when UCX starts
    # in this process; 0 leaves UCX's own threshold. A larger chunk is a rendezvous: its data
    # moves only once the receiver's UCX answered its request-to-send, and over TCP that
    # request queues behind the previous chunk's data, so the link idles for a round trip and
    # two thread wake-ups per chunk (docs/p2p.md). Eager sends have no flow control of their
    # own: a receiver that falls behind the link holds what arrived in UCX's memory, so this
    # suits transfers of bounded size (a request's KV cache), not multi-GB weight pushes.
    eager_bytes: int = 0
    # "auto" decides per chunk from link speed, codec speed and ratio; "on"/"off" force it.
    compression: Compression = "auto"
    # False: compress every chunk before sending the first (for comparison only).
    pipeline: bool = True
    # Every send/receive must make progress within this many seconds, else TransferTimeout.
    deadline_s: float = 10.0
    # Codec threads per chunk; None = paced: the fewest that keep the codec 3x ahead of the
    # measured link, every core until it is measured (adaptive.CodecPacer).
    codec_threads: int | None = None
    # Upper bounds a receiver enforces on what a peer announces.
    max_manifest_bytes: int = 64 << 20
    max_tensors: int = 1 << 20
    # CUDA tensors between processes of one host: "auto" offers the CUDA IPC path (the peer
    # maps this process's GPU memory and copies at device speed; it refuses, and UCX carries
    # the transfer, on another host or without CUDA); "off" never offers it. docs/gpu_p2p.md.
    cuda_ipc: Literal["auto", "off"] = "auto"
    # CUDA tensors into CUDA destinations: "auto" offers the CUDA route first (UCX moves
    # each tensor straight between the GPUs, through its cuda_ipc transport on one host;
    # needs the CUDA transports in UCX_TLS on both sides); the receiver refuses it for
    # host destinations, and the IPC offer or the chunk stream follows. docs/gpu_p2p.md.
    cuda_ucx: Literal["auto", "off"] = "auto"
    # Verify raw GPU-to-GPU transfers (CUDA route and CUDA IPC) with a 64-bit digest computed
    # on both sides. Off by default: the bytes never leave ECC-protected GPU memory, and the
    # two extra reads cost about a third of the copy's speed on one GPU (docs/gpu_p2p.md).
    # Compressed chunks are always verified (each frame carries its CRCs).
    ipc_checksum: bool = False
    # Chunk size of compressed CUDA IPC transfers: the GPU codec needs large calls.
    ipc_chunk_bytes: int = 64 << 20
    # Same-host GPU transfers (CUDA route, CUDA IPC) are chains of steps of microseconds, and
    # in a VM every thread wake-up between them costs ~0.1-0.2 ms (docs/gpu_p2p.md). While
    # one runs, and for gpu_spin_s after it, the UCX loop progresses UCX in a tight loop
    # ("blocking" mode only) instead of sleeping, so a burst of transfers finds it awake.
    gpu_spin_s: float = 0.002
    # A caller outside the UCX loop waits for a same-host GPU transfer up to this long in a
    # GIL-free spin (p2p/loop.py) before it sleeps; its thread (and event loop) is held
    # meanwhile. 0: sleep at once. Both: 0 turns them off; CPU transfers never spin.
    caller_spin_s: float = 0.002

    def __post_init__(self):
        if self.chunk_bytes < 4096 or self.chunk_bytes % 64:
            raise ValueError(f"chunk_bytes must be a multiple of 64 and >= 4096, got {self.chunk_bytes}")
        if self.compression not in ("auto", "on", "off"):
            raise ValueError(f"compression must be 'auto', 'on' or 'off', got {self.compression!r}")
        if self.eager_bytes < 0:
            raise ValueError(f"eager_bytes must be >= 0, got {self.eager_bytes}")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be positive")
        if self.cuda_ipc not in ("auto", "off"):
            raise ValueError(f"cuda_ipc must be 'auto' or 'off', got {self.cuda_ipc!r}")
        if self.cuda_ucx not in ("auto", "off"):
            raise ValueError(f"cuda_ucx must be 'auto' or 'off', got {self.cuda_ucx!r}")
        if self.gpu_spin_s < 0 or self.caller_spin_s < 0:
            raise ValueError("gpu_spin_s and caller_spin_s must be >= 0")
        if self.ipc_chunk_bytes < 4096 or self.ipc_chunk_bytes % 64:
            raise ValueError(f"ipc_chunk_bytes must be a multiple of 64 and >= 4096, got {self.ipc_chunk_bytes}")

    @classmethod
    def from_env(cls, **overrides) -> "TransportConfig":
        """Defaults, then UZIP_P2P_* environment variables, then explicit overrides."""
        env = {}
        if "UZIP_P2P_TLS" in os.environ:
            env["ucx_tls"] = os.environ["UZIP_P2P_TLS"]
        if "UZIP_P2P_COMPRESSION" in os.environ:
            env["compression"] = os.environ["UZIP_P2P_COMPRESSION"]
        if "UZIP_P2P_CHUNK_BYTES" in os.environ:
            env["chunk_bytes"] = int(os.environ["UZIP_P2P_CHUNK_BYTES"])
        if "UZIP_P2P_EAGER_BYTES" in os.environ:
            env["eager_bytes"] = int(os.environ["UZIP_P2P_EAGER_BYTES"])
        if "UZIP_P2P_PROGRESS" in os.environ:
            env["progress_mode"] = os.environ["UZIP_P2P_PROGRESS"]
        if "UZIP_P2P_DEADLINE_S" in os.environ:
            env["deadline_s"] = float(os.environ["UZIP_P2P_DEADLINE_S"])
        if "UZIP_P2P_CUDA_IPC" in os.environ:
            env["cuda_ipc"] = os.environ["UZIP_P2P_CUDA_IPC"]
        if "UZIP_P2P_CUDA_UCX" in os.environ:
            env["cuda_ucx"] = os.environ["UZIP_P2P_CUDA_UCX"]
        if "UZIP_P2P_IPC_CHECKSUM" in os.environ:
            env["ipc_checksum"] = os.environ["UZIP_P2P_IPC_CHECKSUM"].lower() in ("1", "true", "on", "yes")
        if "UZIP_P2P_GPU_SPIN_S" in os.environ:
            env["gpu_spin_s"] = float(os.environ["UZIP_P2P_GPU_SPIN_S"])
        if "UZIP_P2P_CALLER_SPIN_S" in os.environ:
            env["caller_spin_s"] = float(os.environ["UZIP_P2P_CALLER_SPIN_S"])
        return cls(**{**env, **overrides})
