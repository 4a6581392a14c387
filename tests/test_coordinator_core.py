"""The coordinator's transaction logic without gRPC or processes: fast, exact checks."""

import threading

import pytest

from uzip_serve import format as fmt

pytest.importorskip("grpc")

from uzip_serve.coordinator import pb  # noqa: E402
from uzip_serve.coordinator.core import Coordinator, CoordinatorError, plan_transfers  # noqa: E402
from uzip_serve.coordinator.store import Store  # noqa: E402


def spec(name, shape, dtype="bfloat16", shard=None):
    s = pb.TensorSpec(name=name, shape=list(shape), dtype=dtype)
    if shard:
        s.shard.CopyFrom(pb.ShardSpec(dim=shard[0], rank=shard[1], world_size=shard[2]))
    return s


def reg(rid, *specs):
    return pb.RegisterRequest(receiver_id=rid, p2p_address=f"127.0.0.1:{1000 + len(rid)}", device_kind="cpu",
                              expected=list(specs), codec_version=fmt.FORMAT_VERSION)


@pytest.fixture
def core(tmp_path):
    c = Coordinator(Store(str(tmp_path / "s.sqlite3")), lease_s=60)
    yield c
    c.store.close()


def begin(core, version=0, specs=(spec("w", (4, 4)),), timeout=5.0):
    return core.begin_push(pb.BeginPushRequest(version=version, manifest=list(specs), timeout_s=timeout))


def test_a_receiver_of_another_frame_format_is_refused(core):
    old = pb.RegisterRequest(receiver_id="old", p2p_address="127.0.0.1:1", device_kind="cpu",
                             expected=[spec("w", (4, 4))], codec_version=1)
    with pytest.raises(CoordinatorError, match="v1.*v2") as e:
        core.register(old)
    assert e.value.code == "FAILED_PRECONDITION"


def test_versions_increase_and_commit_needs_everyone(core):
    core.register(reg("a", spec("w", (4, 4))))
    core.register(reg("b", spec("w", (4, 4))))
    v = begin(core).version
    assert v == 1
    with pytest.raises(CoordinatorError) as e:
        begin(core)
    assert e.value.code == "FAILED_PRECONDITION"  # one push at a time
    core.report_prepared(pb.ReportPreparedRequest(receiver_id="a", version=v, ok=True))
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", core.finish_push(v, 0)))
    t.start()
    t.join(0.5)
    assert t.is_alive(), "committed before every receiver was prepared"
    core.report_prepared(pb.ReportPreparedRequest(receiver_id="b", version=v, ok=True))
    t.join(5)
    assert done["r"].state == pb.VersionState.VERSION_STATE_COMMITTED
    with pytest.raises(CoordinatorError) as e:
        begin(core, version=1)
    assert e.value.code == "FAILED_PRECONDITION"  # a version never goes back
    assert begin(core, version=5).version == 5


def test_a_failure_report_aborts(core):
    core.register(reg("a", spec("w", (4, 4))))
    v = begin(core).version
    core.report_prepared(pb.ReportPreparedRequest(receiver_id="a", version=v, ok=False, error="ChecksumError"))
    res = core.finish_push(v, 0)
    assert res.state == pb.VersionState.VERSION_STATE_ABORTED and "ChecksumError" in res.reason
    assert core.store.committed_version() == 0


def test_deadline_aborts(core):
    core.register(reg("a", spec("w", (4, 4))))
    v = begin(core, timeout=0.3).version
    res = core.finish_push(v, 0)
    assert res.state == pb.VersionState.VERSION_STATE_ABORTED and "deadline" in res.reason


def test_unknown_receivers_are_rejected(core):
    with pytest.raises(CoordinatorError) as e:
        core.heartbeat("ghost", 0)
    assert e.value.code == "PERMISSION_DENIED"
    core.register(reg("a", spec("w", (4, 4))))
    v = begin(core).version
    with pytest.raises(CoordinatorError) as e:
        core.report_prepared(pb.ReportPreparedRequest(receiver_id="ghost", version=v, ok=True))
    assert e.value.code == "PERMISSION_DENIED"


@pytest.mark.parametrize("manifest,match", [
    ([spec("other", (4, 4))], "not in the push"),
    ([spec("w", (4, 5))], "shape"),
    ([spec("w", (4, 4), dtype="int32")], "holds"),
    ([spec("w", (4, 4)), spec("w", (4, 4))], "twice"),
])
def test_manifests_that_do_not_fit_are_refused(core, manifest, match):
    core.register(reg("a", spec("w", (4, 4))))
    with pytest.raises(CoordinatorError, match=match) as e:
        begin(core, specs=manifest)
    assert e.value.code == "INVALID_ARGUMENT"


def test_float_dtypes_may_differ_and_shards_are_checked(core):
    core.register(reg("a", spec("w", (4, 4), dtype="bfloat16", shard=(0, 1, 2))))
    assert begin(core, specs=[spec("w", (4, 4), dtype="float32")]).version == 1
    core.abort_push(1, "test")
    core.register(reg("b", spec("w", (4, 4), shard=(1, 0, 3))))  # 4 rows do not split in 3
    with pytest.raises(CoordinatorError, match="invalid shard"):
        begin(core)


def test_restart_keeps_numbers_and_aborts_the_push_in_flight(tmp_path):
    path = str(tmp_path / "s.sqlite3")
    c = Coordinator(Store(path))
    c.register(reg("a", spec("w", (4, 4))))
    v = begin(c).version
    c.store.close()
    c = Coordinator(Store(path))  # "restarted" mid-push
    assert c.store.version_state(v)[0] == "ABORTED"
    assert "a" in c._regs
    assert begin(c).version == v + 1
    events = [(e.version, e.state) for e in c.store.events_after(0)]
    assert events == [(v, "ABORTED")]


def test_plan_is_a_chain_per_layout_by_default():
    regs = [reg(f"r{i}", spec("w", (4, 4))) for i in range(4)] + [reg("x", spec("w", (4, 4), dtype="float32"))]
    plan = {t.receiver_id: t.sender for t in plan_transfers(regs, fanout=1)}
    assert plan == {"r0": "trainer", "r1": "r0", "r2": "r1", "r3": "r2", "x": "trainer"}
    tree = {t.receiver_id: t.sender for t in plan_transfers(regs[:4], fanout=2)}
    assert tree == {"r0": "trainer", "r1": "trainer", "r2": "r0", "r3": "r0"}
