"""The coordinator's durable state in SQLite (WAL): receivers, versions, the commit log.

A restart loses nothing: registrations, every version ever begun (so numbers never go
back) and every decision come back from here. Liveness (heartbeats) is deliberately
not stored: after a restart every receiver gets one fresh lease to check in again.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS receivers (
    id TEXT PRIMARY KEY,
    registration BLOB NOT NULL,      -- the RegisterRequest protobuf, as received
    registered_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    state TEXT NOT NULL,             -- PUSHING, COMMITTED, ABORTED
    reason TEXT NOT NULL DEFAULT '',
    began_unix REAL NOT NULL,
    decided_unix REAL,
    raw_bytes INTEGER NOT NULL DEFAULT 0,
    wire_bytes INTEGER NOT NULL DEFAULT 0,
    receivers TEXT NOT NULL DEFAULT '',  -- comma-separated ids in the push
    manifest BLOB                    -- the BeginPushRequest protobuf
);
CREATE TABLE IF NOT EXISTS prepared (
    version INTEGER NOT NULL,
    receiver_id TEXT NOT NULL,
    ok INTEGER NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    wire_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (version, receiver_id)
);
CREATE TABLE IF NOT EXISTS commit_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    unix REAL NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class Event:
    seq: int
    version: int
    state: str
    reason: str
    unix: float


class Store:
    """Thread-safe; every write is its own transaction."""

    def __init__(self, path: str):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed version survives power loss
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # receivers
    def put_receiver(self, rid: str, registration: bytes) -> None:
        self._tx("INSERT OR REPLACE INTO receivers VALUES (?, ?, ?)", (rid, registration, time.time()))

    def receivers(self) -> dict[str, bytes]:
        return {rid: blob for rid, blob in self._tx("SELECT id, registration FROM receivers")}

    # versions
    def highest_version(self) -> int:
        return self._tx("SELECT COALESCE(MAX(version), 0) FROM versions")[0][0]

    def committed_version(self) -> int:
        return self._tx("SELECT COALESCE(MAX(version), 0) FROM versions WHERE state = 'COMMITTED'")[0][0]

    def begin(self, version: int, receivers: list[str], raw_bytes: int, manifest: bytes) -> None:
        self._tx("INSERT INTO versions (version, state, began_unix, raw_bytes, receivers, manifest) "
                 "VALUES (?, 'PUSHING', ?, ?, ?, ?)", (version, time.time(), raw_bytes, ",".join(receivers), manifest))

    def raw_bytes(self, version: int) -> int:
        rows = self._tx("SELECT raw_bytes FROM versions WHERE version = ?", (version,))
        return rows[0][0] if rows else 0

    def pushing(self) -> list[int]:
        return [v for (v,) in self._tx("SELECT version FROM versions WHERE state = 'PUSHING'")]

    def version_state(self, version: int) -> tuple[str, str] | None:
        rows = self._tx("SELECT state, reason FROM versions WHERE version = ?", (version,))
        return rows[0] if rows else None

    def decide(self, version: int, state: str, reason: str = "", wire_bytes: int | None = None) -> Event:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE versions SET state = ?, reason = ?, decided_unix = ?, "
                                 "wire_bytes = COALESCE(?, wire_bytes) WHERE version = ?",
                                 (state, reason, now, wire_bytes, version))
                cur = self._db.execute("INSERT INTO commit_log (version, state, reason, unix) VALUES (?, ?, ?, ?)",
                                       (version, state, reason, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return Event(cur.lastrowid, version, state, reason, now)

    def put_prepared(self, version: int, rid: str, ok: bool, error: str, wire_bytes: int) -> None:
        self._tx("INSERT OR REPLACE INTO prepared VALUES (?, ?, ?, ?, ?)", (version, rid, int(ok), error, wire_bytes))

    def prepared(self, version: int) -> dict[str, tuple[bool, str]]:
        return {rid: (bool(ok), err) for rid, ok, err in
                self._tx("SELECT receiver_id, ok, error FROM prepared WHERE version = ?", (version,))}

    def events_after(self, version: int) -> list[Event]:
        return [Event(*row) for row in self._tx(
            "SELECT seq, version, state, reason, unix FROM commit_log WHERE version > ? ORDER BY seq", (version,))]
