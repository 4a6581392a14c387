"""The layout-changing boundary (uzip_serve.boundary) between real processes over UCX.

Four spawned processes: two ranks of a source stage and two of a destination stage,
connected all-to-all once. Each case (TP 1->2, 2->1, 2->2 along another dim, ...) uses the
ranks its layouts need. Every process generates the same seeded global tensors, so each
destination rank checks, bit for bit, that it received exactly its slice (forward), and
each source rank that it got back exactly its slice of the gradients (backward). Expected
slices come from the coordinator's resharding rule (`uzip_serve.weights._spec_slice`) where
the layout is sharded. Compression is forced on, so the compressed path is what is checked.
Every rank reports through a queue; a failure shows all ranks' tracebacks.
"""

import multiprocessing as mp
import traceback
import zlib

import pytest
import torch

pytest.importorskip("ucxx")

from uzip_serve import boundary  # noqa: E402
from uzip_serve.boundary import Layout  # noqa: E402

CTX = mp.get_context("spawn")

# (source layout, destination layout)
CASES = [
    (Layout(tp=1), Layout(tp=2, dim=0)),  # TP 1 -> 2, rows
    (Layout(tp=1), Layout(tp=2, dim=1)),  # TP 1 -> 2, columns
    (Layout(tp=2, dim=0), Layout(tp=1)),  # TP 2 -> 1
    (Layout(tp=2, dim=1), Layout(tp=1)),
    (Layout(tp=2, dim=0), Layout(tp=2, dim=1)),  # TP 2 -> 2, another shard dim
    (Layout(tp=2, dim=1), Layout(tp=2, dim=0)),
    (Layout(tp=2), Layout(tp=2, dim=1)),  # replicated -> sharded: the source ranks share the sending
    (Layout(tp=2, dim=1), Layout(tp=2)),  # sharded -> replicated (an all-gather across the boundary)
]
# Global shapes per round: [tokens, hidden]; the token count changes from batch to batch.
ROUNDS = [(6, 64), (2, 640), (64, 640)]
DTYPES = {"hidden_states": torch.bfloat16, "residual": torch.float32}


def full_tensor(case: int, rnd: int, key: str, grad: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rnd}/{key}/{grad}".encode()))  # same in every process
    shape = ROUNDS[rnd]
    return (torch.randn(shape, generator=g) * (0.02 if grad else 3.0)).to(DTYPES[key])


def expected(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """The coordinator's rule for a sharded receiver; the whole tensor for a replicated one."""
    if layout.replicated:
        return full
    from uzip_serve.coordinator import pb
    from uzip_serve.weights import _spec_slice

    spec = pb.TensorSpec(name="x", shape=list(full.shape),
                         shard=pb.ShardSpec(dim=layout.dim, rank=rank, world_size=layout.tp))
    return _spec_slice(full, spec)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(iv), b.contiguous().view(iv))


def _rank(q_out, q_in, side: str, rank: int) -> None:
    try:
        from uzip_serve import p2p

        config = p2p.TransportConfig(compression="on", chunk_bytes=64 << 10, deadline_s=60)
        if side == "dst":
            lst = p2p.SyncListener(0, config)
            q_out.put(("port", side, rank, lst.port))
            peers = boundary.accept_peers(lst, 2, timeout=120)
            lst.close()
        else:
            addresses = q_in.get(timeout=120)
            peers = boundary.connect_peers(addresses, rank, config)
        checked = compressed = 0
        for c, (src, dst) in enumerate(CASES):
            mine, other = (src, dst) if side == "src" else (dst, src)
            if rank >= mine.tp:
                continue
            b = boundary.Boundary(src, dst, side=side, rank=rank, peers={r: peers[r] for r in range(other.tp)})
            for rnd, shape in enumerate(ROUNDS):
                shapes = {k: shape for k in DTYPES}
                act = {k: full_tensor(c, rnd, k, grad=False) for k in DTYPES}
                grad = {k: full_tensor(c, rnd, k, grad=True) for k in DTYPES}
                if side == "src":
                    b.send_forward({k: t[src_box(src, shape, rank)] for k, t in act.items()}, shapes)
                    got = b.recv_backward()
                    want = {k: expected(t, src, rank) for k, t in grad.items()}
                else:
                    got = b.recv_forward()
                    want = {k: expected(t, dst, rank) for k, t in act.items()}
                    compressed += sum(s.chunks_compressed for s in b.last_stats.values())
                    b.send_backward({k: t[src_box(dst, shape, rank)] for k, t in grad.items()}, shapes)
                if set(got) != set(want):
                    raise AssertionError(f"case {c} {src}->{dst} round {rnd}: got {sorted(got)}")
                for k in want:
                    if not same_bits(got[k], want[k]):
                        raise AssertionError(f"case {c} {src}->{dst} round {rnd} {side} rank {rank}: {k} differs "
                                             f"({tuple(got[k].shape)} vs {tuple(want[k].shape)})")
                    checked += 1
        q_out.put(("done", side, rank, checked, compressed))
        for ep in peers.values():
            ep.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        q_out.put(("error", side, rank, traceback.format_exc()))


def src_box(layout: Layout, shape, rank):
    return tuple(slice(a, b) for a, b in layout.box(shape, rank))


def test_boundary_layouts_bit_exact_forward_and_backward():
    q_out = CTX.Queue()
    q_in = {r: CTX.Queue() for r in range(2)}
    procs = [CTX.Process(target=_rank, args=(q_out, q_in[r] if side == "src" else None, side, r), daemon=True)
             for side in ("dst", "src") for r in range(2)]
    for p in procs:
        p.start()
    try:
        ports, results, errors = {}, {}, []
        while len(ports) < 2 and not errors:
            msg = q_out.get(timeout=180)
            if msg[0] == "port":
                ports[msg[2]] = ("127.0.0.1", msg[3])
            else:
                errors.append(msg)
        for r in range(2):
            q_in[r].put(ports)
        while len(results) + len(errors) < 4:
            msg = q_out.get(timeout=300)
            if msg[0] == "done":
                results[(msg[1], msg[2])] = msg[3:]
            elif msg[0] == "error":
                errors.append(msg)
        assert not errors, "\n".join(f"--- {side} rank {rank} ---\n{tb}" for _, side, rank, tb in errors)
        # checked tensors per rank: each case a rank takes part in, 3 rounds x 2 tensors
        for (side, rank), (checked, _) in results.items():
            n_cases = sum(1 for s, d in CASES if rank < (s if side == "src" else d).tp)
            assert checked == n_cases * len(ROUNDS) * len(DTYPES), (side, rank, checked)
        assert all(compressed > 0 for side_rank, (_, compressed) in results.items() if side_rank[0] == "dst")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# ---- the plan alone (no processes) ------------------------------------------------------------

@pytest.mark.parametrize("src,dst", CASES + [(Layout(tp=4, dim=0), Layout(tp=2, dim=0)),
                                              (Layout(tp=2, dim=0), Layout(tp=3, dim=0)),
                                              (Layout(tp=3, dim=1), Layout(tp=2, dim=0))])
def test_plan_tiles_each_destination_box_once(src, dst):
    shape = (12, 6)
    for j in range(dst.tp):
        cover = torch.zeros(shape, dtype=torch.int32)
        for p in boundary.plan(shape, src, dst):
            if p.dst == j:
                cover[tuple(slice(a, b) for a, b in p.box)] += 1
                # a piece comes from data its source rank holds
                held = src.box(shape, p.src)
                assert all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(p.box, held))
        want = torch.zeros(shape, dtype=torch.int32)
        want[tuple(slice(a, b) for a, b in dst.box(shape, j))] = 1
        assert torch.equal(cover, want)


def test_uneven_split_and_bad_rank_raise():
    with pytest.raises(ValueError, match="cannot be split"):
        Layout(tp=2, dim=0).box((5, 4), 0)
    with pytest.raises(ValueError, match="outside"):
        Layout(tp=2, dim=0).box((4, 4), 2)
    with pytest.raises(ValueError):
        Layout(tp=0)


def test_assemble_rejects_a_piece_of_the_wrong_shape():
    src, dst = Layout(tp=2, dim=0), Layout(tp=1)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = {i: boundary.outgoing({"x": full[2 * i:2 * i + 2]}, {"x": (4, 6)}, src, dst, i)[0] for i in range(2)}
    assert torch.equal(boundary.assemble(sent, src, dst, 0)["x"], full)
    sent[1] = {k: v[:1] for k, v in sent[1].items()}
    with pytest.raises(ValueError, match="plan says"):
        boundary.assemble(sent, src, dst, 0)
