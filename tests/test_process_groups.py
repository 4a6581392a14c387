"""How `uzip disagg up`, the demo and the benchmarks start vLLM: each process in a process group
of its own (stopped as a whole, children included) but in the caller's session. A session of
its own is an autogroup of its own under Linux's scheduler, and two vLLM instances in separate
autogroups starved each other for ~1 s at a time (docs/kv_connector.md)."""

import os
import sys
import time
from contextlib import ExitStack

from uzip_vllm import demo

CHILD = """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(os.getsid(0), os.getpgid(0), grandchild.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_spawned_processes_keep_our_session_and_are_stopped_as_a_group(tmp_path):
    log = tmp_path / "child.log"
    with ExitStack() as stack:
        proc = demo.spawn(stack, [sys.executable, "-c", CHILD], log)
        deadline = time.monotonic() + 30
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        sid, pgid, grandchild = map(int, log.read_text().split())
        assert sid == os.getsid(0), "a new session would be a new autogroup"
        assert pgid == proc.pid != os.getpgid(0)
        assert _alive(grandchild)
    assert proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the group's stop must take the children too"
