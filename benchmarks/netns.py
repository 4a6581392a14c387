"""A rate-limited link between two network namespaces (veth + tbf), for benchmarks.

Needs root. The namespaces are always torn down: on normal exit, on an exception,
and on SIGINT/SIGTERM (see /work/shared/notes/ucx.md for the recipe's background).

    with RateLimitedLink() as link:
        link.set_rate("1gbit")            # or None for unlimited
        link.popen("a", [...])            # a process inside namespace a (10.77.0.1)
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess

NS = ("uz_a", "uz_b")
ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
DEV = {"a": "uz_va", "b": "uz_vb"}


def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(list(cmd), check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def default_burst(rate: str) -> str:
    """tbf's bucket for `rate`: 2 ms of it, at least two 64 KB packets. A message smaller than
    the bucket crosses at veth speed, which no real link of that rate allows. Measured at
    1 Gbit/s (TCP, a pause between messages as between pipeline steps): with the 1 MB bucket
    used before, 1.26 MB crossed at 4.6 Gbit/s (2.2 ms for 10 ms of wire); with 256 KB at
    1.19 Gbit/s, and 64 MB still at 0.90 Gbit/s (0.92 with 1 MB; 0.86 with 128 KB)."""
    unit = next(u for u in _UNITS if rate.endswith(u))
    nbytes = float(rate[: -len(unit)]) * _UNITS[unit] * 2e-3
    return f"{max(128, round(nbytes / 1024))}kb"


class RateLimitedLink:
    def __init__(self, mtu: int = 65520):
        if os.geteuid() != 0:
            raise PermissionError("the rate-limited link needs root (network namespaces and tc)")
        self.mtu = mtu
        self._up = False

    def __enter__(self) -> "RateLimitedLink":
        self.teardown()  # a previous run that was killed may have left them behind
        atexit.register(self.teardown)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        _sh("ip", "netns", "add", NS[0])
        _sh("ip", "netns", "add", NS[1])
        self._up = True
        _sh("ip", "link", "add", DEV["a"], "type", "veth", "peer", "name", DEV["b"])
        for side, ns in zip("ab", NS):
            _sh("ip", "link", "set", DEV[side], "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ADDR[side]}/24", "dev", DEV[side])
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", DEV[side], "mtu", str(self.mtu), "up")
        return self

    def set_rate(self, rate: str | None, burst: str | None = None) -> None:
        """Caps both directions at `rate` ("1gbit", "10gbit"), or lifts the cap (None).
        `burst`: tbf's bucket (default: default_burst)."""
        for side, ns in zip("ab", NS):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", DEV[side], "root", check=False)
            if rate:
                burst = burst or default_burst(rate)
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", DEV[side], "root", "tbf", "rate", rate,
                    "burst", burst, "latency", "50ms")

    def popen(self, side: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", NS["ab".index(side)], *argv], **kw)

    def _on_signal(self, signum, frame):
        self.teardown()
        raise SystemExit(128 + signum)

    def teardown(self) -> None:
        for ns in NS:
            _sh("ip", "netns", "del", ns, check=False)  # deleting a namespace removes its veth end
        self._up = False

    def __exit__(self, *exc) -> None:
        self.teardown()
