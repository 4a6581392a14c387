"""When the compressed ring pays, decided from measurements every rank agrees on.

Model (per rank; world N, message B bytes, H = 2(N-1) hops, each rank sends
w = 2(N-1)/N * B bytes in a ring all-reduce):

    native      T_n = a_n + w / L
    compressed  T_c = H * (a_h + s * (1/C + 1/D)) + max(rho * w / L,  B * (1/C + (2(N-1)/N) / D))

L: link bytes/s (measured with the native all-reduce), a_n: native latency, C / D:
codec compress / decompress(+reduce) bytes/s measured on this very data while every
rank codes at once, rho: compressed/raw ratio of the data's dtype, a_h: per-hop cost of
the compressed pipeline (header, rendezvous, threads), s: the sub-chunk size. The first
term is the pipeline's fill, the second its steady state: the wire or the codec,
whichever is slower. Each side is scaled by a correction factor learned from the
calls that took it.

The compressed path is taken when B >= threshold(dtype), the smallest size at which
T_c < (1 - margin) * T_n (infinite when the codec is slower than the link). Near the
break-even, where the predicted T_c is within `explore_band` of T_n, the model is not
trusted: sharing cores, the codec and the wire overlap less than its
max() assumes (measured: 10.6 ms for a 1 MiB all-reduce predicted at 8.3). There each
size class (a power of two) is tried both ways, `explore_calls` calls per path
alternating, and the measured times decide from then on.

Every rank must take the same path, so every number that feeds the decision is the
maximum over ranks of what each rank measured (a tiny all-reduce at calibration, at the
end of each size class's trial, and every `resync_every` calls), never a rank's local view.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import statistics

logger = logging.getLogger(__name__)

_ENV = {
    "compression": "UZIP_ALLREDUCE_COMPRESSION",
    "fallback": "UZIP_ALLREDUCE_FALLBACK",
    "min_bytes": "UZIP_ALLREDUCE_MIN_BYTES",
    "link_gbps": "UZIP_ALLREDUCE_LINK_GBPS",
    "margin": "UZIP_ALLREDUCE_MARGIN",
    "sub_chunk_bytes": "UZIP_ALLREDUCE_SUB_CHUNK_BYTES",
    "codec_threads": "UZIP_ALLREDUCE_THREADS",
    "resync_every": "UZIP_ALLREDUCE_RESYNC_EVERY",
    "validate": "UZIP_ALLREDUCE_VALIDATE",
    "explore_calls": "UZIP_ALLREDUCE_EXPLORE_CALLS",
    "transport": "UZIP_ALLREDUCE_TRANSPORT",
    "deadline_s": "UZIP_ALLREDUCE_DEADLINE_S",
}
TRANSPORTS = ("gloo", "ucx", "tcp")


@dataclasses.dataclass(kw_only=True)
class RingConfig:
    """How a ring communicator chooses and runs its paths. Every rank must use the
    same values. `from_env()` reads the UZIP_ALLREDUCE_* variables named below."""

    #: "auto": the model decides; "on": always the compressed ring; "off": never.
    #: (UZIP_ALLREDUCE_COMPRESSION)
    compression: str = "auto"
    #: where uncompressed all-reduces go: "native" (the group's own all-reduce, fastest,
    #: its own summation order) or "ring" (the uncompressed ring: the same bits as the
    #: compressed one). (UZIP_ALLREDUCE_FALLBACK)
    fallback: str = "native"
    #: a fixed threshold in bytes instead of the model's. (UZIP_ALLREDUCE_MIN_BYTES)
    min_bytes: int | None = None
    #: the link's bandwidth in Gbit/s instead of measuring it. (UZIP_ALLREDUCE_LINK_GBPS)
    link_gbps: float | None = None
    #: the compressed path must be predicted this fraction faster. (UZIP_ALLREDUCE_MARGIN)
    margin: float = 0.05
    #: largest sub-chunk, bytes; the pipeline's unit. (UZIP_ALLREDUCE_SUB_CHUNK_BYTES)
    sub_chunk_bytes: int = 1 << 20
    #: smallest sub-chunk, bytes.
    min_sub_chunk_bytes: int = 128 << 10
    #: codec threads per compress/decompress call (UZIP_ALLREDUCE_THREADS).
    codec_threads: int = 1
    #: re-agree on the measurements every this many all-reduces (a 96-byte all-reduce).
    #: (UZIP_ALLREDUCE_RESYNC_EVERY; 0 = never)
    resync_every: int = 256
    #: before every all-reduce, check with one tiny all-reduce that all ranks pass the same
    #: size and dtype; otherwise a mismatch is caught by the hop headers (on the ranks that
    #: see it) or by the native path. (UZIP_ALLREDUCE_VALIDATE=1)
    validate: bool = False
    #: messages below this never consider compression (and never trigger calibration).
    floor_bytes: int = 32 << 10
    #: sizes whose predicted compressed time is within this fraction of the native one
    #: are measured both ways before their size class settles.
    explore_band: float = 0.25
    #: calls per path in such a trial; 0 trusts the model everywhere.
    #: (UZIP_ALLREDUCE_EXPLORE_CALLS)
    explore_calls: int = 4
    #: what carries the CPU ring's hops: "tcp" (sockets of its own, a sender and a receiver
    #: thread per neighbour), "ucx" (ucxx tag messages, UCX's own progress thread) or
    #: "gloo" (torch.distributed isend/irecv on the group). tcp by default: at 1 Gbit/s it
    #: took the 4 MiB all-reduce from 1.23-1.32x gloo's to 1.38-1.42x (docs/collectives.md).
    #: The CUDA backend ignores it (NCCL). (UZIP_ALLREDUCE_TRANSPORT)
    transport: str = "tcp"
    #: ucx / tcp: a hop that makes no progress for this long raises CollectivePeerError.
    #: (UZIP_ALLREDUCE_DEADLINE_S)
    deadline_s: float = 300.0

    def __post_init__(self):
        if self.compression not in ("auto", "on", "off"):
            raise ValueError(f"compression must be auto, on or off, got {self.compression!r}")
        if self.fallback not in ("native", "ring"):
            raise ValueError(f"fallback must be native or ring, got {self.fallback!r}")
        if self.sub_chunk_bytes < 1 or self.min_sub_chunk_bytes < 1:
            raise ValueError("sub-chunk sizes must be positive")
        if self.codec_threads < 1:
            raise ValueError(f"codec_threads must be >= 1, got {self.codec_threads}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")
        if self.explore_calls < 0 or self.explore_band < 0:
            raise ValueError("explore_calls and explore_band must be >= 0")

    @classmethod
    def from_env(cls, **overrides) -> "RingConfig":
        """Defaults, then UZIP_ALLREDUCE_* variables, then `overrides`."""
        kw = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for field, var in _ENV.items():
            raw = os.environ.get(var)
            if raw is None or raw == "":
                continue
            typ = types[field]
            try:
                if "bool" in typ:
                    kw[field] = raw.lower() in ("1", "true", "yes", "on")
                elif "int" in typ:
                    kw[field] = int(raw)
                elif "float" in typ:
                    kw[field] = float(raw)
                else:
                    kw[field] = raw
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {typ}") from None
        kw.update(overrides)
        return cls(**kw)


@dataclasses.dataclass
class Measurements:
    """What the model needs. Seconds and bytes/s. Agreed on by every rank."""

    native_latency_s: float
    link_Bps: float
    compress_Bps: float
    decompress_Bps: float
    hop_latency_s: float
    ratio: dict[str, float] = dataclasses.field(default_factory=dict)  # dtype name -> ratio
    correct_compressed: float = 1.0
    correct_native: float = 1.0


PATHS = ("compressed", "native")


@dataclasses.dataclass
class Trial:
    """One size class near the break-even, tried both ways. `local`: this rank's
    measured / modelled time per path (the model without its global corrections);
    `factors`: the agreed (maximum over ranks) medians, once every rank has them."""

    calls: int = 0
    local: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {p: [] for p in PATHS})
    factors: dict[str, float] | None = None


class AdaptivePolicy:
    """Decides native vs compressed for one communicator. The decision depends only
    on (message size, dtype, call count, agreed measurements): the same on every rank."""

    MIN_THRESHOLD = 4 << 10
    CORRECT_WINDOW = 64

    def __init__(self, config: RingConfig, world: int, sub_bytes_of):
        self.config = config
        self.world = world
        self._sub_bytes_of = sub_bytes_of  # nbytes -> sub-chunk bytes the engine would use
        self.m: Measurements | None = None
        self._thresholds: dict[str, float] = {}
        # Local (not yet agreed) observations of actual/predicted time: the last CORRECT_WINDOW
        # per path. Their median, not a mean: a call here takes 1x or 4x its usual time at
        # random (scheduling on shared cores), and a mean would chase the slow mode.
        self._observed = {p: collections.deque(maxlen=self.CORRECT_WINDOW) for p in PATHS}
        self.local_ratio: dict[str, float] = {}
        self.trials: dict[tuple[str, int], Trial] = {}

    # ---- the model ----

    def predict(self, nbytes: int, dtype_name: str) -> tuple[float, float]:
        """(native seconds, compressed seconds) for one all-reduce of `nbytes`."""
        m, n = self.m, self.world
        hops = 2 * (n - 1)
        wire = hops / n * nbytes
        t_native = m.native_latency_s + wire / m.link_Bps
        sub = min(self._sub_bytes_of(nbytes), max(nbytes // n, 1))
        rho = m.ratio.get(dtype_name, 1.0)
        fill = hops * (m.hop_latency_s + sub * (1 / m.compress_Bps + 1 / m.decompress_Bps))
        steady = max(rho * wire / m.link_Bps, nbytes * (1 / m.compress_Bps + (hops / n) / m.decompress_Bps))
        return t_native * m.correct_native, (fill + steady) * m.correct_compressed

    def threshold(self, dtype_name: str) -> float:
        """Smallest size (bytes) that goes compressed; inf if none does."""
        if self.config.min_bytes is not None:
            return self.config.min_bytes
        t = self._thresholds.get(dtype_name)
        if t is None:
            t = self._thresholds[dtype_name] = self._solve(dtype_name)
        return t

    def _solve(self, dtype_name: str) -> float:
        # Scan down from 1 TiB in 10% steps: the threshold is the smallest size above
        # which every size wins (the fill term can make tiny sizes lose again).
        keep = 1 - self.config.margin
        sizes = [b for b in (int(self.MIN_THRESHOLD * 1.1 ** k) for k in range(300)) if b <= 1 << 40]
        first = math.inf
        for b in reversed(sizes):
            t_native, t_compressed = self.predict(b, dtype_name)
            if t_compressed >= keep * t_native:
                break
            first = b
        return first

    # ---- near the break-even: measure instead of trusting the model ----

    def choose(self, nbytes: int, dtype_name: str) -> str:
        """"compressed", "native", or "agree": this size class's trial is complete and the
        ranks must now agree on its outcome (`trial_report`, then `settle`)."""
        model = "compressed" if nbytes >= self.threshold(dtype_name) else "native"
        if self.config.min_bytes is not None or self.config.explore_calls == 0 or self.config.fallback != "native":
            return model  # (the model predicts the native all-reduce, not the uncompressed ring)
        t_native, t_compressed = self.predict(nbytes, dtype_name)
        m, band = self.m, self.config.explore_band
        # Near the break-even with or without the learned corrections: those are learned on
        # other sizes, and the model's error depends on the size (fill and fixed costs).
        uncorrected = t_compressed / m.correct_compressed / (t_native / m.correct_native)
        key = _trial_key(nbytes, dtype_name)
        if key not in self.trials and abs(t_compressed / t_native - 1) > band and abs(uncorrected - 1) > band:
            return model  # far from the break-even: the model is right often enough
        trial = self.trials.setdefault(key, Trial())
        if trial.factors is not None:  # the measured factors replace the global corrections
            fc, fn = trial.factors["compressed"], trial.factors["native"]
            return "compressed" if uncorrected * fc < (1 - self.config.margin) * fn else "native"
        if trial.calls < 2 * self.config.explore_calls:
            trial.calls += 1
            return PATHS[(trial.calls - 1) % 2]  # compressed first, then alternating
        return "agree"

    def trial_report(self, nbytes: int, dtype_name: str) -> list[float]:
        """This rank's medians (measured / modelled) for the size class, compressed then native."""
        trial = self.trials[_trial_key(nbytes, dtype_name)]
        return [statistics.median_high(trial.local[p]) if trial.local[p] else 1.0 for p in PATHS]

    def settle(self, nbytes: int, dtype_name: str, agreed: list[float]) -> None:
        self.trials[_trial_key(nbytes, dtype_name)].factors = dict(zip(PATHS, agreed))

    def describe(self, dtype_name: str) -> str:
        m = self.m
        t = self.threshold(dtype_name)
        where = "never (the codec is slower than the link)" if math.isinf(t) else f"from {human_bytes(t)} up"
        return (f"link {m.link_Bps / 1e9:.3f} GB/s, native latency {m.native_latency_s * 1e6:.0f} us, codec "
                f"{m.compress_Bps / 1e9:.2f}/{m.decompress_Bps / 1e9:.2f} GB/s (compress/decompress+reduce), "
                f"hop overhead {m.hop_latency_s * 1e6:.0f} us, {dtype_name} ratio "
                f"{m.ratio.get(dtype_name, 1.0):.3f}, corrections {m.correct_compressed:.2f}/"
                f"{m.correct_native:.2f} -> compressed {where}")

    # ---- learning ----

    def observe(self, path: str, nbytes: int, dtype_name: str, seconds: float, ratio: float | None) -> None:
        if self.m is None or nbytes < self.config.floor_bytes:
            return
        tn, tc = self.predict(nbytes, dtype_name)
        pred = (tc / self.m.correct_compressed) if path == "compressed" else (tn / self.m.correct_native)
        if pred > 0:
            x = seconds / pred
            trial = self.trials.get(_trial_key(nbytes, dtype_name))
            if trial is None:  # the global corrections learn from sizes the model decides alone
                self._observed[path].append(x)
            elif trial.factors is None:
                trial.local[path].append(x)
        if ratio is not None:
            old = self.local_ratio.get(dtype_name)
            self.local_ratio[dtype_name] = ratio if old is None else 0.7 * old + 0.3 * ratio

    def local_correction(self, path: str) -> float | None:
        """This rank's measured / modelled time of `path` (median of recent calls), or None."""
        xs = self._observed[path]
        return statistics.median_high(xs) if xs else None

    def set_measurements(self, m: Measurements) -> None:
        self.m = m
        self._thresholds.clear()


def _trial_key(nbytes: int, dtype_name: str) -> tuple[str, int]:
    return dtype_name, max(nbytes, 1).bit_length()  # size classes [2^k, 2^(k+1))


def human_bytes(nbytes: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k:
            return f"{nbytes / (1 << k):.1f} {unit}"
    return f"{int(nbytes)} B"
