"""Versioned weight pushes with real processes on loopback: the coordinator (a `uzip
coordinator` subprocess), receivers (spawned processes) and the trainer (this process)."""

import hashlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch

pytest.importorskip("grpc")
pytest.importorskip("ucxx")

import uzip_serve as uz  # noqa: E402
from uzip_serve import format as fmt  # noqa: E402
from uzip_serve.coordinator import client, pb  # noqa: E402

CTX = mp.get_context("spawn")
TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digests(tensors: dict) -> dict:
    return {k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}


class Coordinator:
    def __init__(self, state_path, token=TOKEN, lease=2.0):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "uzip_serve.cli", "coordinator", "--listen", self.address, "--state",
                     str(state_path), "--lease", str(lease)]
        if token:
            tf = state_path.with_suffix(".token")
            tf.write_text(token)
            self.args += ["--token-file", str(tf)]
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        ch, _ = client.connect(self.address)
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(100):
            try:
                if health.Check(health_pb2.HealthCheckRequest(service="uzip.v1.Coordinator"), timeout=1).status == 1:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.1)
        else:
            raise AssertionError("coordinator did not come up: " + self.proc.stderr.read().decode()[-2000:])
        ch.close()

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def state(self):
        ch, stub = client.connect(self.address, token=TOKEN)
        try:
            return stub.GetState(pb.GetStateRequest(), timeout=5)
        finally:
            ch.close()


def _receiver_main(q, coordinator, rid, template, shards, token):
    try:
        def on_commit(version, tensors):
            q.put(("commit", rid, version, digests(tensors)))

        r = uz.WeightReceiver({k: torch.empty(s, dtype=d) for k, (s, d) in template.items()}, coordinator=coordinator,
                              receiver_id=rid, token=token, shards=shards, on_commit=on_commit).start()
        q.put(("ready", rid, os.getpid(), None))
        while True:
            time.sleep(3600)
    except BaseException as e:  # noqa: BLE001
        q.put(("error", rid, type(e).__name__, traceback.format_exc()))


class Receivers:
    def __init__(self, coordinator, specs, token=TOKEN):
        """specs: rid -> (template {name: (shape, dtype)}, shards or None)."""
        self.q = CTX.Queue()
        self.coordinator, self.token, self.procs, self.pids = coordinator, token, {}, {}
        for rid, (template, shards) in specs.items():
            self.spawn(rid, template, shards)

    def spawn(self, rid, template, shards=None):
        p = CTX.Process(target=_receiver_main, args=(self.q, self.coordinator, rid, template, shards, self.token),
                        daemon=True)
        p.start()
        self.procs[rid] = p
        kind, _, pid, _ = self.next("ready")
        self.pids[rid] = p.pid

    def next(self, kind, timeout=60):
        msg = self.q.get(timeout=timeout)
        if msg[0] == "error":
            raise AssertionError(f"receiver {msg[1]} failed: {msg[2]}\n{msg[3]}")
        assert msg[0] == kind, msg
        return msg

    def commits(self, n, timeout=30):
        return [self.next("commit", timeout) for _ in range(n)]

    def no_commit_within(self, seconds):
        try:
            msg = self.q.get(timeout=seconds)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected message {msg[:3]}")

    def kill(self, rid):
        os.kill(self.pids[rid], signal.SIGKILL)
        self.procs[rid].join(10)

    def stop(self):
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)


def wait_for(cond, timeout, message):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.1)


def model_weights(seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(512, 256, generator=gen) * 0.02 * scale).to(torch.bfloat16),
        "layer0.qkv.weight": (torch.randn(768, 256, generator=gen) * 0.02 * scale).to(torch.bfloat16),
        "layer0.norm.weight": torch.ones(256, dtype=torch.bfloat16) * scale,
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def template_of(w):
    return {k: (tuple(v.shape), v.dtype) for k, v in w.items()}


@pytest.fixture
def coord(tmp_path):
    c = Coordinator(tmp_path / "state.sqlite3")
    yield c
    c.kill()


def push(coord, weights, **kw):
    return uz.push_weights(weights, coordinator=coord.address, token=TOKEN, progress=False,
                           **{"timeout": 20, **kw})


def test_three_receivers_twenty_versions(coord):
    w = model_weights(0)
    rs = Receivers(coord.address, {f"r{i}": (template_of(w), None) for i in range(3)})
    try:
        for v in range(1, 21):
            weights = model_weights(v)
            res = push(coord, weights)
            assert res.version == v and sorted(res.receivers) == ["r0", "r1", "r2"]
            got = rs.commits(3)
            assert {m[1] for m in got} == {"r0", "r1", "r2"}
            assert all(m[2] == v for m in got), "committed out of order"
            assert all(m[3] == digests(weights) for m in got), "a receiver holds different bits"
        state = coord.state()
        assert state.committed_version == 20
        for _ in range(50):  # heartbeats report what each receiver serves
            serving = [r.serving_version for r in coord.state().receivers]
            if serving == [20, 20, 20]:
                break
            time.sleep(0.2)
        assert serving == [20, 20, 20]
    finally:
        rs.stop()


def test_receiver_killed_mid_push_then_recovery(coord):
    # Large enough that the push is surely still running when the kill lands.
    w = {"big": torch.randn(64 << 20).to(torch.bfloat16), "small": torch.ones(10)}
    tmpl = template_of(w)
    rs = Receivers(coord.address, {f"r{i}": (tmpl, None) for i in range(3)})
    try:
        push(coord, w)
        rs.commits(3)
        import threading

        threading.Timer(0.3, rs.kill, args=("r1",)).start()
        t0 = time.monotonic()
        with pytest.raises(uz.PushError):
            push(coord, {k: v + 1 for k, v in w.items()}, timeout=15)
        assert time.monotonic() - t0 < 15 + 5, "the push outlived its deadline"
        rs.no_commit_within(2)  # survivors still serve version 1
        assert coord.state().committed_version == 1
        # The next push leaves the dead receiver out (after its lease ran out) and succeeds.
        time.sleep(2.5)
        w3 = {k: v + 3 for k, v in w.items()}
        res = push(coord, w3)
        assert sorted(res.receivers) == ["r0", "r2"]
        assert {m[1] for m in rs.commits(2)} == {"r0", "r2"}
        # Back again after it re-registers.
        rs.spawn("r1", tmpl)
        w4 = {k: v + 4 for k, v in w.items()}
        res = push(coord, w4)
        assert sorted(res.receivers) == ["r0", "r1", "r2"]
        got = rs.commits(3)
        assert all(m[2] == res.version and m[3] == digests(w4) for m in got)
    finally:
        rs.stop()


def test_coordinator_restart_keeps_state_and_versions(coord):
    w = model_weights(1)
    rs = Receivers(coord.address, {"r0": (template_of(w), None)})
    try:
        assert push(coord, w).version == 1
        assert push(coord, model_weights(2)).version == 2
        rs.commits(2)
        coord.kill()
        coord.start()  # same state file
        assert coord.state().committed_version == 2
        assert [r.receiver_id for r in coord.state().receivers] == ["r0"]
        # r0 checks in with the new process by itself: serving_version is not stored, only a
        # heartbeat to this process sets it. Pushing before that would lean on the grace lease
        # a restart gives stored receivers (2 s here), a race on a loaded box.
        wait_for(lambda: [(r.receiver_id, r.live, r.serving_version) for r in coord.state().receivers]
                 == [("r0", True, 2)], 30, "r0 did not check in with the restarted coordinator")
        res = push(coord, model_weights(3))
        assert res.version == 3  # numbers never go back
        assert rs.commits(1)[0][2] == 3  # the receiver's watch reconnected by itself
    finally:
        rs.stop()


def test_prepared_report_waits_for_the_coordinator(tmp_path):
    """A receiver whose channel to the coordinator is down (a restart, then gRPC's reconnect
    backoff) when it finishes staging keeps its PREPARED report until the coordinator
    answers, instead of dropping it and leaving the push to abort at its deadline."""
    from uzip_serve.coordinator.core import Coordinator as Core
    from uzip_serve.coordinator.server import build_server
    from uzip_serve.coordinator.store import Store

    address = f"127.0.0.1:{free_port()}"
    w = model_weights(1)
    manifest = [pb.TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                for n, t in w.items()]
    r = uz.WeightReceiver(dict(w), coordinator=address, receiver_id="r0", token=TOKEN)
    r._channel, r._stub = client.connect(address, token=TOKEN)  # no start(): only the report path
    report = threading.Thread(target=r._report, args=(1, True, "", 123, time.time() + 60), daemon=True)
    report.start()
    time.sleep(2)  # connects refused meanwhile: the channel is backing off
    assert report.is_alive(), "the report was given up while the coordinator was away"
    core = Core(Store(str(tmp_path / "s.sqlite3")), lease_s=60)
    server, _ = build_server(core, address, token=TOKEN)
    try:
        core.register(pb.RegisterRequest(receiver_id="r0", p2p_address="127.0.0.1:1", device_kind="cpu",
                                         expected=manifest, codec_version=fmt.FORMAT_VERSION))
        assert core.begin_push(pb.BeginPushRequest(manifest=manifest, timeout_s=60)).version == 1
        server.start()
        report.join(30)
        assert not report.is_alive(), "the report did not get through"
        assert core.store.prepared(1) == {"r0": (True, "")}
    finally:
        r._stop.set()
        r._channel.close()
        server.stop(0)
        core.store.close()


def test_wrong_token_stale_version_and_corrupt_chunk(coord, corrupt_chunks):
    w = model_weights(5)
    rs = Receivers(coord.address, {"r0": (template_of(w), None), "r1": (template_of(w), None)})
    try:
        with pytest.raises(uz.PushError) as e:
            uz.push_weights(w, coordinator=coord.address, token="wrong", progress=False)
        assert e.value.code == "UNAUTHENTICATED"
        with pytest.raises(uz.PushError) as e:
            uz.push_weights(w, coordinator=coord.address, token=None, progress=False)
        assert e.value.code == "UNAUTHENTICATED"
        assert push(coord, w, version=7).version == 7
        rs.commits(2)
        with pytest.raises(uz.PushError) as e:
            push(coord, w, version=7)
        assert e.value.code == "FAILED_PRECONDITION"
        with pytest.raises(uz.PushError) as e:
            push(coord, w, version=3)
        assert e.value.code == "FAILED_PRECONDITION"
        # A manifest that misses a tensor a receiver expects is refused, not half-applied.
        partial = dict(w)
        del partial["step"]
        with pytest.raises(uz.PushError) as e:
            push(coord, partial)
        assert e.value.code == "INVALID_ARGUMENT"

        # Corrupt one chunk on the wire: the receiver's checksum fails, nobody commits.
        with corrupt_chunks(0x01), pytest.raises(uz.PushError, match="ChecksumError|checksum|aborted"):
            push(coord, model_weights(6))
        rs.no_commit_within(2)
        assert coord.state().committed_version == 7
        assert push(coord, model_weights(8)).version == 9  # 8 was used by the aborted push
        assert all(m[3] == digests(model_weights(8)) for m in rs.commits(2))
    finally:
        rs.stop()


def test_resharding_two_halves(coord):
    w = {"wq": (torch.randn(64, 48) * 0.02).to(torch.bfloat16), "wo": (torch.randn(48, 64) * 0.02),
         "bias": torch.randn(64)}
    half = {"wq": ((32, 48), torch.bfloat16), "wo": ((48, 32), torch.float32), "bias": ((64,), torch.float32)}
    rs = Receivers(coord.address, {
        "tp0": (half, {"wq": (0, 0, 2), "wo": (1, 0, 2)}),
        "tp1": (half, {"wq": (0, 1, 2), "wo": (1, 1, 2)}),
    })
    try:
        push(coord, w)
        got = {m[1]: m[3] for m in rs.commits(2)}
        for rank, rid in enumerate(["tp0", "tp1"]):
            expect = {"wq": w["wq"][32 * rank:32 * (rank + 1)], "wo": w["wo"][:, 32 * rank:32 * (rank + 1)],
                      "bias": w["bias"]}
            assert got[rid] == digests(expect), rid
    finally:
        rs.stop()


def test_dtype_cast_after_lossless_transfer(coord):
    w = {"w": torch.randn(300, 40)}  # an fp32 trainer
    rs = Receivers(coord.address, {"bf16": ({"w": ((300, 40), torch.bfloat16)}, None),
                                   "fp32": ({"w": ((300, 40), torch.float32)}, None)})
    try:
        push(coord, w)
        got = {m[1]: m[3] for m in rs.commits(2)}
        assert got["fp32"] == digests(w)
        assert got["bf16"] == digests({"w": w["w"].to(torch.bfloat16)})
    finally:
        rs.stop()
