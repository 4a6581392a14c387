"""The coordinator's logic, free of gRPC: versions as transactions over many receivers.

The servicer (server.py) only translates between RPCs and these methods; errors are
CoordinatorError with the gRPC status name they map to. All state changes happen under
one condition variable, which FinishPush and WatchVersions wait on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from uzip_serve import format as fmt
from uzip_serve.coordinator import pb
from uzip_serve.coordinator.store import Event, Store

logger = logging.getLogger(__name__)
TRAINER = "trainer"


class CoordinatorError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name, e.g. "FAILED_PRECONDITION"


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def check_fit(manifest: dict[str, "pb.TensorSpec"], reg: "pb.RegisterRequest") -> None:
    """Raises unless the manifest gives this receiver everything it expects, whole."""
    for spec in reg.expected:
        sent = manifest.get(spec.name)
        where = f"receiver {reg.receiver_id!r}, tensor {spec.name!r}"
        if sent is None:
            raise CoordinatorError("INVALID_ARGUMENT", f"{where}: not in the push (a partial update is refused)")
        if list(sent.shape) != list(spec.shape):
            raise CoordinatorError("INVALID_ARGUMENT", f"{where}: push has shape {list(sent.shape)}, "
                                                       f"receiver expects {list(spec.shape)}")
        if sent.dtype != spec.dtype and not (_is_float(sent.dtype) and _is_float(spec.dtype)):
            raise CoordinatorError("INVALID_ARGUMENT", f"{where}: push has {sent.dtype}, receiver holds {spec.dtype}")
        if spec.HasField("shard"):
            s = spec.shard
            if s.dim >= len(spec.shape) or s.world_size == 0 or s.rank >= s.world_size \
                    or spec.shape[s.dim] % s.world_size:
                raise CoordinatorError("INVALID_ARGUMENT", f"{where}: invalid shard {s.rank}/{s.world_size} "
                                                           f"along dim {s.dim} of {list(spec.shape)}")


def layout_key(reg: "pb.RegisterRequest") -> bytes:
    """Receivers with equal keys expect identical bytes, so one can relay to another."""
    return b"".join(sorted(s.SerializeToString(deterministic=True) for s in reg.expected))


def plan_transfers(regs: list["pb.RegisterRequest"], fanout: int) -> list["pb.Transfer"]:
    """A fan-out tree per group of identical layouts: the trainer sends to at most
    `fanout` receivers of a group, each of which relays to at most `fanout` more, so
    the trainer's link carries each group's bytes a bounded number of times."""
    groups: dict[bytes, list] = {}
    for r in sorted(regs, key=lambda r: r.receiver_id):
        groups.setdefault(layout_key(r), []).append(r)
    plan = []
    for members in groups.values():
        for i, r in enumerate(members):
            sender = TRAINER if i < fanout else members[(i - fanout) // fanout].receiver_id
            plan.append(pb.Transfer(sender=sender, receiver_id=r.receiver_id, p2p_address=r.p2p_address,
                                    expected=list(r.expected)))
    return plan


class Coordinator:
    def __init__(self, store: Store, *, heartbeat_interval_s: float = 1.0, lease_s: float = 5.0,
                 default_timeout_s: float = 120.0, fanout: int = 1, metrics=None):
        self.store = store
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lease_s = lease_s
        self.default_timeout_s = default_timeout_s
        self.fanout = fanout
        self.metrics = metrics
        self._cv = threading.Condition()
        self._regs: dict[str, pb.RegisterRequest] = {}
        now = time.monotonic()
        for rid, blob in store.receivers().items():
            self._regs[rid] = pb.RegisterRequest.FromString(blob)
        # Every stored receiver gets one lease after a restart to check in again.
        self._last_seen = {rid: now for rid in self._regs}
        self._serving: dict[str, int] = {}
        self._active: tuple[int, list[str], float] | None = None  # version, receivers, monotonic deadline
        for v in store.pushing():  # a push cut short by a restart can never complete
            store.decide(v, "ABORTED", "coordinator restarted during the push")

    # -- receivers --
    def register(self, req: "pb.RegisterRequest") -> "pb.RegisterResponse":
        if not req.receiver_id or not req.p2p_address:
            raise CoordinatorError("INVALID_ARGUMENT", "receiver_id and p2p_address are required")
        if req.codec_version and req.codec_version != fmt.FORMAT_VERSION:
            raise CoordinatorError("FAILED_PRECONDITION", f"receiver decodes frame format v{req.codec_version}; "
                                                          f"this deployment uses v{fmt.FORMAT_VERSION}")
        names = [s.name for s in req.expected]
        if len(set(names)) != len(names):
            raise CoordinatorError("INVALID_ARGUMENT", "a tensor name is expected twice")
        with self._cv:
            self.store.put_receiver(req.receiver_id, req.SerializeToString())
            self._regs[req.receiver_id] = req
            self._last_seen[req.receiver_id] = time.monotonic()
            self._cv.notify_all()
        logger.info("receiver %s registered (%s, %d tensors, %s)", req.receiver_id, req.device_kind,
                    len(req.expected), req.p2p_address)
        return pb.RegisterResponse(committed_version=self.store.committed_version(),
                                   heartbeat_interval_s=self.heartbeat_interval_s, lease_s=self.lease_s)

    def heartbeat(self, rid: str, serving: int) -> int:
        with self._cv:
            self._known(rid)
            self._last_seen[rid] = time.monotonic()
            self._serving[rid] = serving
        return self.store.committed_version()

    def _known(self, rid: str) -> None:
        if rid not in self._regs:
            raise CoordinatorError("PERMISSION_DENIED", f"unknown receiver {rid!r}: register first")

    def _live(self, rid: str, now: float) -> bool:
        return now - self._last_seen.get(rid, -1e18) <= self.lease_s

    # -- pushes --
    def begin_push(self, req: "pb.BeginPushRequest") -> "pb.BeginPushResponse":
        manifest = {}
        for spec in req.manifest:
            if spec.name in manifest:
                raise CoordinatorError("INVALID_ARGUMENT", f"tensor {spec.name!r} appears twice in the manifest")
            if spec.dtype not in fmt.DTYPES_BY_NAME:
                raise CoordinatorError("INVALID_ARGUMENT", f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}")
            manifest[spec.name] = spec
        with self._cv:
            self._expire_locked()
            if self._active is not None:
                raise CoordinatorError("FAILED_PRECONDITION", f"version {self._active[0]} is still being pushed")
            highest = self.store.highest_version()
            version = req.version or highest + 1
            if version <= highest:
                raise CoordinatorError("FAILED_PRECONDITION",
                                       f"version {version} is stale: version {highest} was already pushed")
            now = time.monotonic()
            live = [r for rid, r in self._regs.items() if self._live(rid, now)]
            if not live:
                raise CoordinatorError("UNAVAILABLE", "no live receiver is registered")
            for r in live:
                check_fit(manifest, r)
            timeout = req.timeout_s or self.default_timeout_s
            receivers = sorted(r.receiver_id for r in live)
            self.store.begin(version, receivers, req.raw_bytes, req.SerializeToString())
            self._active = (version, receivers, now + timeout)
            self._cv.notify_all()
        if self.metrics:
            self.metrics.pushes_begun.inc()
        logger.info("push of version %d begun to %d receivers", version, len(receivers))
        return pb.BeginPushResponse(version=version, plan=plan_transfers(live, self.fanout),
                                    deadline_unix_s=time.time() + timeout, receivers=receivers)

    def report_prepared(self, req: "pb.ReportPreparedRequest") -> None:
        with self._cv:
            self._known(req.receiver_id)
            self._last_seen[req.receiver_id] = time.monotonic()
            if self._active is None or self._active[0] != req.version:
                logger.info("late report from %s for version %d ignored", req.receiver_id, req.version)
                return
            if req.receiver_id not in self._active[1]:
                raise CoordinatorError("PERMISSION_DENIED", f"{req.receiver_id!r} is not part of this push")
            self.store.put_prepared(req.version, req.receiver_id, req.ok, req.error, req.wire_bytes)
            self._cv.notify_all()

    def finish_push(self, version: int, wire_bytes: int) -> "pb.FinishPushResponse":
        with self._cv:
            while True:
                state = self.store.version_state(version)
                if state is None:
                    raise CoordinatorError("NOT_FOUND", f"version {version} was never begun")
                if state[0] != "PUSHING":
                    break
                _, receivers, deadline = self._active
                prepared = self.store.prepared(version)
                failed = [f"{rid}: {err}" for rid, (ok, err) in prepared.items() if not ok]
                now = time.monotonic()
                lost = [rid for rid in receivers if rid not in prepared and not self._live(rid, now)]
                if failed:
                    self._decide_locked(version, "ABORTED", "receiver failed: " + "; ".join(failed), "receiver_failed")
                elif lost:
                    self._decide_locked(version, "ABORTED", "receiver lost: " + ", ".join(lost), "receiver_lost")
                elif len(prepared) == len(receivers):
                    self._decide_locked(version, "COMMITTED", "", None, wire_bytes)
                elif now >= deadline:
                    missing = sorted(set(receivers) - set(prepared))
                    self._decide_locked(version, "ABORTED", "deadline passed waiting for " + ", ".join(missing),
                                        "deadline")
                else:
                    self._cv.wait(min(0.25, deadline - now))
            state, reason = self.store.version_state(version)
            return pb.FinishPushResponse(version=version, state=pb.VersionState.Value(f"VERSION_STATE_{state}"),
                                         reason=reason, receivers=sorted(self.store.prepared(version)))

    def abort_push(self, version: int, reason: str) -> None:
        with self._cv:
            state = self.store.version_state(version)
            if state is None:
                raise CoordinatorError("NOT_FOUND", f"version {version} was never begun")
            if state[0] == "PUSHING":
                self._decide_locked(version, "ABORTED", reason or "aborted by the trainer", "trainer_abort")

    def _decide_locked(self, version: int, state: str, reason: str, cause: str | None,
                       wire_bytes: int | None = None) -> None:
        self.store.decide(version, state, reason, wire_bytes)
        if self._active and self._active[0] == version:
            self._active = None
        self._cv.notify_all()
        logger.info("version %d %s%s", version, state, f": {reason}" if reason else "")
        if self.metrics:
            if state == "COMMITTED":
                self.metrics.pushes_committed.inc()
            else:
                self.metrics.failures.labels(cause or "other").inc()

    def _expire_locked(self) -> None:
        if self._active is not None and time.monotonic() >= self._active[2]:
            self._decide_locked(self._active[0], "ABORTED", "deadline passed", "deadline")

    def expire(self) -> None:
        """Aborts a push whose deadline passed without FinishPush (called periodically)."""
        with self._cv:
            self._expire_locked()

    # -- watching --
    def watch(self, after: int, is_active=lambda: True, poll_s: float = 0.5) -> Iterator[Event]:
        seq = 0
        while is_active():
            events = [e for e in self.store.events_after(after) if e.seq > seq]
            for e in events:
                seq = e.seq
                yield e
            with self._cv:
                self._cv.wait(poll_s)

    def state(self) -> "pb.GetStateResponse":
        now = time.monotonic()
        with self._cv:
            infos = [pb.ReceiverInfo(receiver_id=rid, p2p_address=r.p2p_address, device_kind=r.device_kind,
                                     live=self._live(rid, now), serving_version=self._serving.get(rid, 0))
                     for rid, r in sorted(self._regs.items())]
        return pb.GetStateResponse(committed_version=self.store.committed_version(),
                                   highest_version=self.store.highest_version(), receivers=infos)
