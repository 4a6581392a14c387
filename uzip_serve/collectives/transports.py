"""Hop transports for the CPU ring that do not go through gloo's point-to-point pairs.

Why: on the 2-core VM one gloo `isend`/`irecv` blocked 1.5-6 ms in about half of the
4 MiB all-reduces, on both ranks at once (gloo's device thread spins on a readable
socket while the posting thread holds the pair's lock; docs/collectives.md). The ring
only needs ordered, tagged, one-directional messages to its right neighbour and from its
left one, so it can carry them itself:

  UcxP2P     ucxx's core API: one UCX worker per communicator with its C++ progress thread
             (blocking mode: it sleeps in epoll), tag send/receive; no Python thread and no
             event loop between the caller and UCX.
  SocketP2P  plain TCP: one socket per direction, a sender thread (sendall) and a receiver
             thread (recv_into the posted buffer, MSG_WAITALL), both with the GIL released
             while the bytes move.

Both have TorchP2P's interface (isend/irecv -> work with .wait(), exact_sizes = False: a
receive buffer may be larger than the message). Endpoints are made once per
communicator; addresses are exchanged with an all_gather of uint8 tensors on the group
(nothing received is unpickled). A dead peer or one that makes no progress within
`deadline_s` is a `CollectivePeerError`, never a hang; `close()` stops every thread
and endpoint (also at interpreter exit, through a finalizer).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING

from uzip_serve.collectives.base import CollectiveError, CollectivePeerError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
__all__ = ["CollectivePeerError", "SocketP2P", "UcxP2P"]


def _all_gather_bytes(group, data: bytes) -> list[bytes]:
    """Every rank's `data`, through two all_gathers of tensors (lengths, then padded bytes)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    m = max(int(x) for x in lens)
    mine = torch.zeros(m, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.zeros(m, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [bytes(p[:int(k)].numpy()) for p, k in zip(parts, lens)]


def _group_ranks(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _as_numpy(buf: "torch.Tensor"):
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise CollectiveError("hop buffers must be contiguous CPU tensors")
    return buf.view(-1).numpy()


# ---- UCX ------------------------------------------------------------------------------


class _UcxWork:
    __slots__ = ("_req", "_what", "_transport", "__weakref__")

    def __init__(self, req, what: str, transport: "UcxP2P"):
        self._req, self._what, self._transport = req, what, transport

    def wait(self) -> None:
        req = self._req
        if req is None:
            raise CollectivePeerError(f"{self._what}: the UCX transport was closed")
        if not req.completed:
            # ucxx's core API has no blocking wait: poll, sleeping (the progress thread and
            # the kernel move the bytes meanwhile); 20 us sleeps come back in 60-80 us.
            deadline = time.monotonic() + self._transport.deadline_s
            while not req.completed:
                if time.monotonic() > deadline:
                    raise CollectivePeerError(f"{self._what}: no progress within {self._transport.deadline_s:g} s "
                                              "(peer stuck or gone)")
                time.sleep(20e-6)
        try:
            req.check_error()
        except Exception as e:  # noqa: BLE001 - ucxx's exception types, translated
            raise CollectivePeerError(f"{self._what} failed: {type(e).__name__}: {e}"
                                      + (" (a message larger than the posted buffer: every rank must pass "
                                         "the same size and dtype)" if "runcat" in str(e) else "")) from e


def _ucx_shutdown(state: dict) -> None:
    worker = state.pop("worker", None)
    if worker is None:
        return
    # A work the caller still holds must not keep the worker and context alive (and with
    # them UCX's async thread): it lets go of its request and raises if waited on.
    for w in list(state.get("works", ())):
        w._req = None
    try:
        worker.cancel_inflight_requests()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
    try:
        worker.stop_progress_thread()
    except Exception:  # noqa: BLE001
        pass
    state.clear()  # endpoints, buffers of cancelled requests, then the worker and context go


class UcxP2P:
    """Ring hops over UCX tag messages (ucxx core API). Collective to construct."""

    exact_sizes = False

    def __init__(self, group, *, deadline_s: float = 300.0, tls: str | None = None):
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        # Eager messages only: a hop is 0.1-1 MB, and with UCX's rendezvous (a request, a
        # reply, then the data) the ring made 0.95-1.15x gloo's all-reduce at 4 MiB, 1 Gbit/s,
        # against 1.33-1.43x eager (2-core VM; docs/collectives.md). UCX takes it only from
        # the environment at the time libucp is loaded (measured: set later, through
        # config_dict or the environment, the context's config showed "inf" and the ring ran
        # at the rendezvous numbers), so it is set around the import and put back; a
        # process that loaded UCX before (uzip_serve.p2p) keeps what it had. The user's
        # UCX_RNDV_THRESH wins.
        unset = "UCX_RNDV_THRESH" not in os.environ
        if unset:
            os.environ["UCX_RNDV_THRESH"] = "inf"
        try:
            import ucxx._lib.libucxx as ucx_api
            from ucxx._lib.arr import Array
        finally:
            if unset:
                os.environ.pop("UCX_RNDV_THRESH", None)

        self._api, self._Array = ucx_api, Array
        self.deadline_s = deadline_s
        self.rank, self.world = _group_ranks(group)
        # TLS: the environment's UCX_TLS wins; otherwise TCP only. (With UCX's default,
        # ranks on one host would talk through shared memory, which a benchmark of a
        # network link must not, and which a multi-host group never can.)
        config = {"TLS": os.environ.get("UCX_TLS") or tls or "tcp"}
        ctx = ucx_api.UCXContext(config_dict=config,
                                 feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        worker = ucx_api.UCXWorker(ctx)
        worker.start_progress_thread(polling_mode=False, epoll_timeout=-1)
        # Requests in flight keep their buffers here: UCX writes into them until they complete
        # (or are cancelled at close), whatever the caller drops.
        self._state = {"ctx": ctx, "worker": worker, "eps": {}, "inflight": collections.deque(),
                       "works": weakref.WeakSet()}
        self._finalizer = weakref.finalize(self, _ucx_shutdown, self._state)
        try:
            addrs = _all_gather_bytes(group, worker.address.tobytes())
            peers = {(self.rank + 1) % self.world, (self.rank - 1) % self.world} - {self.rank}
            for p in sorted(peers):
                addr = ucx_api.UCXAddress.create_from_buffer(addrs[p])
                self._state["eps"][p] = ucx_api.UCXEndpoint.create_from_worker_address(worker, addr, True)
        except BaseException:
            self.close()
            raise
        self._tag = ucx_api.UCXXTag

    def _post(self, op: str, buf: "torch.Tensor", peer: int, tag: int) -> _UcxWork:
        st = self._state
        if "worker" not in st:
            raise CollectivePeerError("the UCX transport is closed")
        inflight = st["inflight"]
        while inflight and inflight[0][0].completed:
            inflight.popleft()
        arr = self._Array(_as_numpy(buf))
        ep = st["eps"][peer]
        try:
            req = ep.tag_send(arr, self._tag(tag)) if op == "send" else ep.tag_recv(arr, self._tag(tag))
        except Exception as e:  # noqa: BLE001 - translated
            raise CollectivePeerError(f"rank {self.rank}: posting a {op} to rank {peer} failed: {e}") from e
        inflight.append((req, arr, buf))
        work = _UcxWork(req, f"rank {self.rank}: {op} of tag {tag} {'to' if op == 'send' else 'from'} rank {peer}",
                        self)
        st["works"].add(work)
        return work

    def isend(self, buf, peer: int, tag: int) -> _UcxWork:
        return self._post("send", buf, peer, tag)

    def irecv(self, buf, peer: int, tag: int) -> _UcxWork:
        return self._post("recv", buf, peer, tag)

    def close(self) -> None:
        self._finalizer()


# ---- TCP sockets ---------------------------------------------------------------------

_FRAME = struct.Struct("<qq")  # tag, payload bytes: what precedes every message on the wire
_HELLO = struct.Struct("<8sqq")  # magic, sender's rank, communicator nonce
_HELLO_MAGIC = b"UZARTCP1"


class _SockWork:
    __slots__ = ("_done", "_error", "buf", "what", "deadline_s")

    def __init__(self, buf, what: str, deadline_s: float):
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.buf = buf  # a writable/readable memoryview of the tensor (kept alive here)
        self.what = what
        self.deadline_s = deadline_s

    def finish(self, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def wait(self) -> None:
        if not self._done.wait(self.deadline_s):
            raise CollectivePeerError(f"{self.what}: no progress within {self.deadline_s:g} s (peer stuck or gone)")
        if self._error is not None:
            raise self._error


def _local_address(group) -> str:
    """This host's address as the group's peers reach it: the one a packet to the
    rendezvous store's host leaves from (UZIP_ALLREDUCE_HOST overrides)."""
    if os.environ.get("UZIP_ALLREDUCE_HOST"):
        return os.environ["UZIP_ALLREDUCE_HOST"]
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR")
    if not host:
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host = getattr(store, "host", None) or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _sock_shutdown(state: dict) -> None:
    state["closed"] = True
    err = CollectivePeerError("the TCP transport was closed")
    for s in state.get("socks", ()):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    qcond = state.get("qcond")
    if qcond is not None:
        with qcond:
            for q in state.get("send_queues", {}).values():
                q.append(None)
            qcond.notify_all()
    with state["cond"]:
        state["cond"].notify_all()
    for t in state.get("threads", ()):
        if t is not threading.current_thread():
            t.join(5)
    for s in state.get("socks", ()):
        s.close()
    for by_tag in state.get("posted", {}).values():
        for works in by_tag.values():
            for w in works:
                w.finish(err)


class SocketP2P:
    """Ring hops over plain TCP sockets, one per direction per neighbour. Collective to
    construct."""

    exact_sizes = False
    SOCK_BUF = 4 << 20

    def __init__(self, group, *, deadline_s: float = 300.0):
        self.deadline_s = deadline_s
        self.rank, self.world = _group_ranks(group)
        right, left = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        cond = threading.Condition()
        st = self._state = {"cond": cond, "closed": False, "socks": [], "threads": [], "posted": {},
                            "send_queues": {}, "dead": {}}
        self._finalizer = weakref.finalize(self, _sock_shutdown, st)
        if self.world == 1:
            return
        try:
            host = _local_address(group)
            lst = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            lst.bind((host, 0))
            lst.listen(4)
            st["socks"].append(lst)
            nonce = int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0
            me = f"{host}|{lst.getsockname()[1]}|{nonce}".encode("ascii")
            every = [b.decode("ascii").split("|") for b in _all_gather_bytes(group, me)]
            nonce = int(every[0][2])
            # Connect to the right neighbour (our sends), accept the left one (our receives).
            out = socket.create_connection((every[right][0], int(every[right][1])), timeout=deadline_s)
            out.sendall(_HELLO.pack(_HELLO_MAGIC, self.rank, nonce))
            lst.settimeout(deadline_s)
            inc, _ = lst.accept()
            inc.settimeout(deadline_s)
            magic, src, their_nonce = _HELLO.unpack(_recv_exact(inc, _HELLO.size))
            if magic != _HELLO_MAGIC or src != left or their_nonce != nonce:
                raise CollectivePeerError(f"rank {self.rank}: unexpected connection (magic {magic!r}, rank {src}, "
                                          f"expected rank {left})")
            for s in (out, inc):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                st["socks"].append(s)
            inc.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.SOCK_BUF)
            out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.SOCK_BUF)
            st["posted"][left] = {}
            q = st["send_queues"][right] = collections.deque()
            qcond = threading.Condition()
            st["qcond"] = qcond
            for target, name, args in ((_sender, f"uzip-ar-send-{right}", (st, out, q, qcond, self.rank, right)),
                                       (_receiver, f"uzip-ar-recv-{left}", (st, inc, left, self.rank))):
                t = threading.Thread(target=target, args=args, name=name, daemon=True)
                t.start()
                st["threads"].append(t)
        except BaseException:
            self.close()
            raise

    def isend(self, buf, peer: int, tag: int) -> _SockWork:
        st = self._state
        w = _SockWork(memoryview(_as_numpy(buf)).cast("B"), f"rank {self.rank}: send of tag {tag} to rank {peer}",
                      self.deadline_s)
        if st["closed"] or peer not in st["send_queues"]:
            w.finish(CollectivePeerError(f"{w.what}: the transport is closed or has no link to that rank"))
        else:
            with st["qcond"]:
                st["send_queues"][peer].append((tag, w))
                st["qcond"].notify()
        return w

    def irecv(self, buf, peer: int, tag: int) -> _SockWork:
        st = self._state
        w = _SockWork(memoryview(_as_numpy(buf)).cast("B"), f"rank {self.rank}: receive of tag {tag} from rank {peer}",
                      self.deadline_s)
        with st["cond"]:
            dead = st["dead"].get(peer)
            if dead is not None or st["closed"] or peer not in st["posted"]:
                w.finish(dead or CollectivePeerError(f"{w.what}: the transport is closed or has no link to that rank"))
            else:
                st["posted"][peer].setdefault(tag, collections.deque()).append(w)
                st["cond"].notify_all()
        return w

    def close(self) -> None:
        self._finalizer()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def _sender(st: dict, sock: socket.socket, q: collections.deque, qcond: threading.Condition, rank: int,
            peer: int) -> None:
    error = None
    while True:
        with qcond:
            while not q:
                qcond.wait()
            item = q.popleft()
        if item is None:
            break
        tag, w = item
        if error is not None:
            w.finish(error)
            continue
        try:
            sock.sendall(_FRAME.pack(tag, len(w.buf)))
            sock.sendall(w.buf)
            w.finish()
        except OSError as e:
            error = CollectivePeerError(f"rank {rank}: sending to rank {peer} failed ({e}): the peer is gone")
            w.finish(error)
    if error is None:
        error = CollectivePeerError("the TCP transport was closed")
    with qcond:
        for item in q:
            if item is not None:
                item[1].finish(error)
        q.clear()


def _receiver(st: dict, sock: socket.socket, peer: int, rank: int) -> None:
    cond = st["cond"]
    posted = st["posted"][peer]
    head = bytearray(_FRAME.size)
    try:
        while True:
            _recv_into_exact(sock, memoryview(head))
            tag, n = _FRAME.unpack(head)
            with cond:
                while not posted.get(tag) and not st["closed"]:
                    cond.wait()
                if st["closed"]:
                    return
                w = posted[tag].popleft()
            cap = len(w.buf)
            if n <= cap:
                _recv_into_exact(sock, w.buf[:n])
                w.finish()
            else:  # the header still arrives (the engine names the mismatch); the rest is dropped
                _recv_into_exact(sock, w.buf)
                rest = n - cap
                junk = bytearray(min(rest, 1 << 20))
                while rest:
                    k = min(rest, len(junk))
                    _recv_into_exact(sock, memoryview(junk)[:k])
                    rest -= k
                w.finish(CollectivePeerError(
                    f"{w.what}: a message of {n} bytes for a {cap}-byte buffer: every rank must pass the same "
                    "size and dtype"))
    except (OSError, ConnectionError) as e:
        err = CollectivePeerError(f"rank {rank}: the connection from rank {peer} broke ({e}): the peer is gone"
                                  if not st["closed"] else "the TCP transport was closed")
        with cond:
            st["dead"][peer] = err
            for works in posted.values():
                for w in works:
                    w.finish(err)
                works.clear()
