"""A boundary communicator: tensors that change tensor-parallel layout between two stages.

A stage holds each tensor in a `Layout`: `tp` ranks, each holding an even slice along `dim`
(rank r holds `t.narrow(dim, r * n, n)`, n = size // tp, the coordinator's `ShardSpec`
rule, `uzip_serve.weights._spec_slice`), or the whole tensor on every rank (`dim=None`).
When the next stage has another layout (TP 1 -> 2, 2 -> 1, 2 -> 2 sharded along another
dim, ...), each destination rank must get exactly the part it holds in its own layout, and
nothing twice. `plan()` says which source rank sends which box to which destination rank;
`Boundary` runs it over `uzip_serve.p2p` endpoints (split-send, adaptive compression):

    forward   activations, source layout -> destination layout (source ranks send)
    backward  gradients,   destination layout -> source layout (destination ranks send),
              the same plan with the roles swapped. A gradient is assumed to be laid out
              like the activation it belongs to (full values, no partial sums).

Every rank of both stages builds the same plan from the layouts and the tensors' global
shapes; only the global shape travels (in the tensor's name in the p2p manifest, a binary
header; nothing is pickled), since it depends on the batch. Which pairs exchange data does
not depend on the shapes, so connections are made once, for all pairs (`connect_peers`,
`accept_peers`).

A replicated source has every destination box on every source rank: destination rank j is
served by source rank j % tp, so the source ranks share the sending.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

_SHAPE_SEP = "@"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int  # ranks of the stage (its tensor-parallel size)
    dim: int | None = None  # the dim each rank holds an even slice of; None = replicated

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"Layout.tp must be >= 1, got {self.tp}")
        if self.dim is not None and self.dim < 0:
            raise ValueError(f"Layout.dim must be >= 0 or None, got {self.dim}")

    def box(self, shape: Sequence[int], rank: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dim of the part of a tensor of global `shape` that `rank` holds."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside a layout of {self.tp} ranks")
        out = [(0, s) for s in shape]
        if self.dim is not None and self.tp > 1:
            if self.dim >= len(shape) or shape[self.dim] % self.tp:
                raise ValueError(f"a shape {tuple(shape)} cannot be split {self.tp} ways along dim {self.dim}")
            n = shape[self.dim] // self.tp
            out[self.dim] = (rank * n, (rank + 1) * n)
        return tuple(out)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box(shape, rank))

    @property
    def replicated(self) -> bool:
        return self.dim is None or self.tp == 1


@dataclasses.dataclass(frozen=True)
class Piece:
    """`box` (global [start, stop) per dim) goes from source rank `src` to destination rank `dst`."""

    src: int
    dst: int
    box: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)


def _intersect(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) else None


def plan(shape: Sequence[int], src: Layout, dst: Layout) -> list[Piece]:
    """Every piece of a tensor of global `shape` that crosses from `src` to `dst`, ordered by
    (dst, src). The pieces for one destination rank tile its box exactly, once."""
    pieces = []
    for j in range(dst.tp):
        want = dst.box(shape, j)
        if math.prod(shape) == 0:
            continue
        if src.replicated:
            pieces.append(Piece(j % src.tp, j, want))
            continue
        for i in range(src.tp):
            got = _intersect(src.box(shape, i), want)
            if got is not None:
                pieces.append(Piece(i, j, got))
    return pieces


def pairs(src: Layout, dst: Layout) -> set[tuple[int, int]]:
    """(source rank, destination rank) pairs that may exchange data in either direction."""
    return {(i, j) for i in range(src.tp) for j in range(dst.tp)}


def _slices(box, origin) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))


def _name(key: str, shape: Sequence[int]) -> str:
    return f"{key}{_SHAPE_SEP}{'x'.join(map(str, shape))}"


def _parse(name: str) -> tuple[str, tuple[int, ...]]:
    key, sep, dims = name.rpartition(_SHAPE_SEP)
    if not sep:
        raise ValueError(f"boundary piece {name!r} carries no global shape")
    return key, tuple(int(d) for d in dims.split("x")) if dims else ()


def outgoing(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], src: Layout, dst: Layout,
             rank: int) -> dict[int, dict[str, torch.Tensor]]:
    """What source rank `rank` sends, per destination rank: {dst: {name@shape: piece}}.
    `tensors` are this rank's local parts, `shapes` the global shapes."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        shape = tuple(shapes[key])
        mine = src.box(shape, rank)
        if tuple(t.shape) != tuple(b - a for a, b in mine):
            raise ValueError(f"{key!r}: rank {rank} holds {tuple(t.shape)}, layout {src} says "
                             f"{tuple(b - a for a, b in mine)} of {shape}")
        origin = tuple(a for a, _ in mine)
        for p in plan(shape, src, dst):
            if p.src == rank:
                out.setdefault(p.dst, {})[_name(key, shape)] = t[_slices(p.box, origin)].contiguous()
    return out


def assemble(received: Mapping[int, Mapping[str, torch.Tensor]], src: Layout, dst: Layout,
             rank: int) -> dict[str, torch.Tensor]:
    """Destination rank `rank`'s local tensors from the pieces it received, {src: {name@shape: piece}}.
    Checks that every piece is the planned one and that the box is covered."""
    by_key: dict[str, tuple[tuple[int, ...], dict[int, torch.Tensor]]] = {}
    for i, named in received.items():
        for name, t in named.items():
            key, shape = _parse(name)
            prev = by_key.setdefault(key, (shape, {}))
            if prev[0] != shape:
                raise ValueError(f"{key!r}: source ranks disagree on the global shape ({prev[0]} vs {shape})")
            prev[1][i] = t
    out = {}
    for key, (shape, parts) in by_key.items():
        mine = dst.box(shape, rank)
        origin = tuple(a for a, _ in mine)
        planned = [p for p in plan(shape, src, dst) if p.dst == rank]
        if set(parts) != {p.src for p in planned}:
            raise ValueError(f"{key!r}: pieces came from source ranks {sorted(parts)}, "
                             f"the plan says {sorted(p.src for p in planned)}")
        first = next(iter(parts.values()))
        full = torch.empty(tuple(b - a for a, b in mine), dtype=first.dtype, device=first.device)
        for p in planned:
            piece = parts[p.src]
            if tuple(piece.shape) != p.shape or piece.dtype != first.dtype:
                raise ValueError(f"{key!r}: source rank {p.src} sent {piece.dtype} {tuple(piece.shape)}, "
                                 f"the plan says {p.shape}")
            full[_slices(p.box, origin)] = piece
        out[key] = full
    return out


class Boundary:
    """One rank's side of a layout-changing boundary between stage A (`src`) and stage B (`dst`).

    `side` is "src" (a rank of stage A) or "dst" (a rank of stage B); `peers` maps each rank of
    the other stage to a connected `uzip_serve.p2p` endpoint (async `Endpoint` or `SyncEndpoint`).
    Calls are blocking and collective over both stages: in a forward every source rank calls
    `send_forward` and every destination rank `recv_forward`; a backward the other way round.
    The transfers to (or from) different peers run concurrently on the process's UCX loop.
    """

    def __init__(self, src: Layout, dst: Layout, *, side: str, rank: int, peers: Mapping[int, object]):
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        other = dst if side == "src" else src
        missing = set(range(other.tp)) - set(peers)
        if missing:
            raise ValueError(f"no endpoint for ranks {sorted(missing)} of the other stage")
        self.src, self.dst, self.side, self.rank = src, dst, side, rank
        self.peers = {r: getattr(ep, "_ep", ep) for r, ep in peers.items()}  # the async endpoints
        self.last_stats: dict[int, object] = {}

    # forward: activations A -> B
    def send_forward(self, tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]) -> dict:
        self._need("src")
        return self._send(outgoing(tensors, shapes, self.src, self.dst, self.rank))

    def recv_forward(self) -> dict[str, torch.Tensor]:
        self._need("dst")
        return assemble(self._recv(self._senders(self.src, self.dst)), self.src, self.dst, self.rank)

    # backward: gradients B -> A
    def send_backward(self, grads: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]]) -> dict:
        self._need("dst")
        return self._send(outgoing(grads, shapes, self.dst, self.src, self.rank))

    def recv_backward(self) -> dict[str, torch.Tensor]:
        self._need("src")
        return assemble(self._recv(self._senders(self.dst, self.src)), self.dst, self.src, self.rank)

    # --
    def _need(self, side: str) -> None:
        if self.side != side:
            raise RuntimeError(f"this call belongs to the {side!r} side; this rank is on the {self.side!r} side")

    def _senders(self, a: Layout, b: Layout) -> list[int]:
        """Source ranks that send to this rank. Shape-independent: plan on a shape that splits evenly."""
        probe = [math.lcm(a.tp, b.tp)] * (1 + max(a.dim or 0, b.dim or 0))
        return sorted({p.src for p in plan(probe, a, b) if p.dst == self.rank})

    def _send(self, per_peer: dict[int, dict[str, torch.Tensor]]) -> dict:
        from uzip_serve.p2p.loop import run

        async def go():
            peers = sorted(per_peer)
            stats = await asyncio.gather(*(self.peers[r].send_tensors(per_peer[r]) for r in peers))
            return dict(zip(peers, stats))

        self.last_stats = run(go()) if per_peer else {}
        return self.last_stats

    def _recv(self, senders: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        from uzip_serve.p2p.loop import run

        async def go():
            got = await asyncio.gather(*(self.peers[r].recv_tensors() for r in senders))
            return dict(zip(senders, got))

        out = run(go()) if senders else {}
        self.last_stats = {r: self.peers[r].last_stats for r in senders}
        return out


# ---- connecting the two stages ---------------------------------------------------------------

def accept_peers(listener, count: int, timeout: float = 60.0) -> dict[int, object]:
    """On each rank of one stage: accepts `count` peers (a `p2p.SyncListener`), each of which
    names its rank first (`connect_peers`). Returns {peer rank: SyncEndpoint}."""
    peers = {}
    for _ in range(count):
        ep = listener.accept(timeout)
        rank = int.from_bytes(ep.recv_bytes(16), "little")
        if rank in peers:
            raise RuntimeError(f"peer rank {rank} connected twice")
        peers[rank] = ep
    return peers


def connect_peers(addresses: Mapping[int, tuple[str, int]], my_rank: int, config=None) -> dict[int, object]:
    """On each rank of the other stage: connects to every listed peer {rank: (host, port)}
    and names itself. Returns {peer rank: SyncEndpoint}."""
    from uzip_serve import p2p

    peers = {}
    for rank, (host, port) in sorted(addresses.items()):
        ep = p2p.connect_sync(host, port, config)
        ep.send_bytes(my_rank.to_bytes(4, "little"))
        peers[rank] = ep
    return peers
