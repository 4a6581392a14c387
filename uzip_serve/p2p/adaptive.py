"""Whether a chunk is worth compressing, decided from measurements, and the stats that show why.

With the split-send pipeline, a compressed chunk costs about
    max(compress time, wire time of the compressed bytes, decompress time)
and a raw one costs its raw wire time. The policy compares the two with what it has
measured so far on this link (wire bytes per second), of this codec (GB/s), and of
this very chunk (the ratio of a one-block probe), and sends raw unless compression
wins by a margin. Random data probes at ratio ~1.0 and goes raw; a fast link makes
the codec the bottleneck and goes raw; a slow link with weights goes compressed.

The model knows bytes and speeds, not a transfer's fixed costs (the probe, thread hops,
frame headers, the last chunk's decode), which decide small transfers: a two-chunk PP step
measured 1.1-1.4x raw compressed where the model predicted a gain. So the policy also keeps
what whole transfers really took, per size class (a power of two), compressed and raw; once
a class has an outcome, that outcome replaces the model's guess for its path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import time

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Ewma:
    """Exponentially weighted mean; None until the first sample."""

    alpha: float = 0.3
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class CodecPacer:
    """How many codec threads one side of a link gives each chunk: the fewest that keep the
    codec PACE times faster than the link carries bytes, and every core while either speed
    is unknown.

    One thread compresses real bf16 at about 0.9 GB/s, seven times what a 1 Gbit/s link
    carries, so more threads only help on fast links. On shared cores they cost: a chunk split
    over all cores waits for its slowest share, and every preemption (the peer's codec, the
    kernel's TCP, the model's forward) stalls the whole chunk. Measured on the 2-core VM, a
    10 MB PP step over 1 Gbit/s: all cores on both sides 0.78-0.80x raw, one thread each
    0.72-0.73x, one side at one thread 0.76-0.79x (docs/p2p.md).

    Speeds: `wire` is bytes per second the link really carried end to end (raw or compressed
    transfers alike: a codec that paces the link shows up as a slow link and gets threads);
    one thread's speed is the fastest of the last ONE_THREAD_WINDOW single-thread calls,
    PRIOR_ONE_THREAD until one was measured. The fastest, because a preempted call reads slow
    and says nothing about the codec: with a mean, one such call put a chunk on two threads,
    whose calls never measure one thread again (measured: a 164 KB PP step stuck at 3.7 ms,
    a scheduler tick, instead of 1.1). Calls spread over several threads are not used at all:
    their per-thread share reads slow for the same reason."""

    PACE = 3.0
    # Below what one thread of the C codec does on real bf16 here (0.8-1.0 GB/s), so an
    # unmeasured machine is not held to one thread on a link it cannot keep up with.
    PRIOR_ONE_THREAD = 0.5e9
    ONE_THREAD_WINDOW = 16

    def __init__(self):
        self.wire = Ewma()
        self.one_thread_samples: collections.deque[float] = collections.deque(maxlen=self.ONE_THREAD_WINDOW)

    @property
    def one_thread(self) -> float | None:
        """Raw bytes per second of one codec thread (None: not measured)."""
        return max(self.one_thread_samples, default=None)

    def threads(self, most: int) -> int:
        link = self.wire.value
        if not link or most <= 1:
            return max(1, most)
        one = self.one_thread or self.PRIOR_ONE_THREAD
        return max(1, min(most, math.ceil(self.PACE * link / one)))

    def observe_codec(self, raw_bytes: int, seconds: float, threads: int) -> None:
        if threads == 1 and raw_bytes >= AdaptivePolicy.MIN_BYTES and seconds > 0:
            self.one_thread_samples.append(raw_bytes / seconds)

    def observe_wire(self, wire_bytes: int, seconds: float) -> None:
        if wire_bytes >= AdaptivePolicy.MIN_BYTES and seconds > 0:
            self.wire.add(wire_bytes / seconds)


@dataclasses.dataclass(frozen=True)
class Decision:
    compress: bool
    reason: str
    nbytes: int
    probe_ratio: float | None
    link_gbps: float | None
    compress_gbps: float | None
    decompress_gbps: float | None


@dataclasses.dataclass
class TransferStats:
    """One transfer, as seen from one side. `ratio` is wire bytes over raw bytes."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    chunks: int = 0
    chunks_compressed: int = 0
    seconds: float = 0.0
    # Which data path carried it: "ucx" (the chunk stream), "ucx_cuda" (UCX moved the CUDA
    # tensors GPU to GPU, same host; "ucx_cuda_staged" on a receiver that took them through a
    # GPU buffer into host memory or several GPUs) or "cuda_ipc" (our IPC handles, same host).
    path: str = "ucx"
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    # Receiver, CUDA route: the payload landed in receives posted before the transfer's
    # header arrived (ucx_cuda.PrePost).
    preposted: bool = False
    # Codec threads per chunk (the most any chunk of this transfer used; 0: no codec call).
    codec_threads: int = 0

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def gbps(self) -> float:
        """Effective raw GB/s: original bytes over wall time."""
        return self.raw_bytes / self.seconds / 1e9 if self.seconds else 0.0


class AdaptivePolicy:
    """Per-link compression policy. Not thread-safe: one sender endpoint owns one."""

    # Assumed before anything is measured: a 2-core CPU codec. Replaced by measurements.
    PRIOR_COMPRESS_GBPS = 0.8
    PRIOR_DECOMPRESS_GBPS = 1.0
    # Compress only if the model says it saves at least this fraction of the raw time.
    MARGIN = 0.10
    # Below this a chunk goes raw: headers and the probe would cost more than they save.
    MIN_BYTES = 64 << 10
    # A link_is_peak policy takes its link as slow only after this many slow transfers.
    PEAK_SAMPLES = 3
    # Once both paths have outcomes for a size class, every this-many-th transfer of it takes
    # the losing path, to re-measure it; every RECHECK_EARLY-th while the loser has fewer than
    # OUTCOME_MIN outcomes (a first sample taken while the link was cold can be 2x slow).
    RECHECK_EVERY = 16
    RECHECK_EARLY = 4
    OUTCOME_MIN = 3
    # Outcomes kept per size class and path; their median decides.
    OUTCOME_WINDOW = 9

    def __init__(self, mode: str = "auto", *, prior_link_gbps: float | None = None,
                 prior_compress_gbps: float | None = None, prior_decompress_gbps: float | None = None):
        self.mode = mode
        self.link = Ewma(value=prior_link_gbps and prior_link_gbps * 1e9)  # wire bytes per second
        # The GPU routes' link is a copy within one host: its capacity does not vary, only the
        # fixed costs around it do, so the fastest transfer measured is the estimate, and it
        # counts as slow only once PEAK_SAMPLES transfers all were.
        self.link_is_peak = False
        self.link_samples = 0
        # Whether self.link holds an end-to-end measurement (observe_link) rather than only
        # chunk send completions (observe_chunk_send).
        self.link_measured = False
        self.compress_speed = Ewma()  # raw bytes per second
        self.decompress_speed = Ewma()  # raw bytes per second, as reported by a receiver
        # When the last send on this link completed: a pipelined send queued behind it
        # started using the wire only then.
        self.link_free_at = 0.0
        # The sender's codec threads per chunk (CodecPacer), when the config leaves them open.
        self.pacer = CodecPacer()
        # Seconds per raw byte of the last whole transfers, per size class and path:
        # {class: {compressed: deque}}, and how many transfers of each class were observed.
        self.outcomes: dict[int, dict[bool, collections.deque]] = {}
        self.observed: dict[int, int] = {}
        # Priors stand in for measurements not made yet (a path's expected link, the codec it uses).
        if prior_compress_gbps:
            self.PRIOR_COMPRESS_GBPS = prior_compress_gbps
        if prior_decompress_gbps:
            self.PRIOR_DECOMPRESS_GBPS = prior_decompress_gbps

    @classmethod
    def for_cuda_ipc(cls, mode: str = "auto") -> "AdaptivePolicy":
        """The GPU routes' policy (CUDA route and IPC). Until measured, the link is assumed
        NVLink-class (400 GB/s; one GPU copies at ~2000). The codec stands for what a compressed
        GPU transfer really moves end to end, the IPC chunked pipeline with its per-chunk
        syncs: 36-42 GB/s measured on the H200 (docs/gpu_p2p.md), not the kernels' 0.2-0.3
        TB/s. A link sample is a whole transfer's bytes over its time, fixed costs included
        (256 MiB in ~1.2-1.5 ms on one H200: "170-220 GB/s"), so with the kernels' speed as the
        prior one slow first transfer sent `auto` into the chunked mode at 37 GB/s (0.2x raw).
        Compression is considered only on a path measured slower than ~36 GB/s (GPUs without
        peer access, staged through host memory)."""
        policy = cls(mode, prior_link_gbps=400.0, prior_compress_gbps=40.0, prior_decompress_gbps=40.0)
        # The first transfer from or into a new buffer also pays its IPC mapping: one such
        # 256 MiB transfer measured as a slow "link" sent the next 1 GiB through the codec.
        policy.link_is_peak = True
        return policy

    def observe_link(self, wire_bytes: int, seconds: float, *, lower_bound: bool = False) -> None:
        """An end-to-end measurement: bytes until the receiver acknowledged them.
        `lower_bound`: the transfer was (partly) compressed, so the codec may have paced it and
        the link is at least this fast; such a sample only ever raises the estimate (else a
        link measured through a slow codec would look slow and keep compression on for good)."""
        if wire_bytes < self.MIN_BYTES or seconds <= 0:
            return
        speed = wire_bytes / seconds
        if lower_bound:
            if self.link_measured and speed > self.link.value:
                self.link.add(speed)
            return
        if not self.link_measured:
            self.link, self.link_measured = Ewma(), True  # drop the chunk-send estimates (and the prior)
        self.link_samples += 1
        if self.link_is_peak:
            self.link.value = max(self.link.value or 0.0, speed)
        else:
            self.link.add(speed)

    def observe_chunk_send(self, wire_bytes: int, seconds: float) -> None:
        """A chunk's send completing: it completes once the bytes sit in the socket buffers, so
        on TCP this overstates the link (0.32 GB/s on a 0.125 GB/s link, and more while the
        codec, not the link, paces the sends). It stands in only until a transfer of this
        link was measured end to end, so that a link's first transfer can still adapt."""
        if not self.link_measured and wire_bytes >= self.MIN_BYTES and seconds > 0:
            self.link.add(wire_bytes / seconds)

    def observe_compress(self, raw_bytes: int, seconds: float) -> None:
        if raw_bytes >= self.MIN_BYTES and seconds > 0:
            self.compress_speed.add(raw_bytes / seconds)

    def observe_decompress(self, raw_bytes: int, seconds: float) -> None:
        if raw_bytes >= self.MIN_BYTES and seconds > 0:
            self.decompress_speed.add(raw_bytes / seconds)

    @staticmethod
    def size_class(transfer_bytes: int) -> int:
        return max(0, int(transfer_bytes).bit_length() - 1)

    def observe_transfer(self, raw_bytes: int, seconds: float, compressed: bool) -> None:
        """A whole transfer, every chunk of it compressed (or every chunk raw), start to ack."""
        if raw_bytes >= self.MIN_BYTES and seconds > 0:
            k = self.size_class(raw_bytes)
            window = self.outcomes.setdefault(k, {}).setdefault(compressed, collections.deque(maxlen=self.OUTCOME_WINDOW))
            window.append(seconds / raw_bytes)
            self.observed[k] = self.observed.get(k, 0) + 1

    def _outcomes(self, transfer_bytes: int | None) -> tuple[float | None, float | None]:
        """Seconds per raw byte that transfers of this size class took (compressed, raw)."""
        by_mode = self.outcomes.get(self.size_class(transfer_bytes), {}) if transfer_bytes else {}
        zip_seen, raw_seen = by_mode.get(True), by_mode.get(False)
        return (statistics.median_high(zip_seen) if zip_seen else None,
                statistics.median_high(raw_seen) if raw_seen else None)

    def _measured(self, transfer_bytes: int | None, zip_seen: float | None,
                  raw_seen: float | None) -> tuple[bool, str] | None:
        """(compress?, why) from whole transfers of this size class when both paths have
        outcomes (compression if its median beats raw's by MARGIN; every RECHECK_EVERY-th
        transfer the other one, to re-measure it); None otherwise."""
        if zip_seen is None or raw_seen is None:
            return None
        # The model's margin here too: near a tie (noisy outcomes, 0.8-1.3x from one transfer
        # to the next on shared cores) raw is the one that cannot lose.
        compress = zip_seen < (1 - self.MARGIN) * raw_seen
        why = f"measured: {zip_seen / raw_seen:.2f}x raw compressed for transfers of this size"
        k = self.size_class(transfer_bytes)
        losing = len(self.outcomes[k][not compress])
        every = self.RECHECK_EARLY if losing < self.OUTCOME_MIN else self.RECHECK_EVERY
        if self.observed.get(k, 0) % every == 0:
            return not compress, why + "; re-measuring the other path"
        return compress, why

    def needs_probe(self, nbytes: int, transfer_bytes: int | None = None) -> bool:
        """Whether the chunk's ratio could change the decision. On a link faster than
        the codec even a perfect ratio loses, and where whole transfers of this size
        measured faster raw, so the probe (a one-block compression) is skipped there and
        costs nothing."""
        if self.mode != "auto" or nbytes < self.MIN_BYTES:
            return False
        measured = self._measured(transfer_bytes, *self._outcomes(transfer_bytes))
        if measured is not None and not measured[0]:
            return False
        link = self.link.value
        if link is None or (self.link_is_peak and self.link_samples < self.PEAK_SAMPLES):
            return False
        c = self.compress_speed.value or self.PRIOR_COMPRESS_GBPS * 1e9
        d = self.decompress_speed.value or self.PRIOR_DECOMPRESS_GBPS * 1e9
        return max(1 / c, 1 / d) < (1 - self.MARGIN) / link

    def decide(self, nbytes: int, probe_ratio: float | None, *, chunks_in_transfer: int | None = None,
               transfer_bytes: int | None = None) -> Decision:
        """Whether to compress a chunk of `nbytes`. `chunks_in_transfer`: how many chunks its
        transfer has, so that the pipeline's fill and drain (the first chunk's compression,
        the last one's decompression, which nothing overlaps) are charged too.
        `transfer_bytes`: its raw size, whose size class may have measured outcomes."""
        link = self.link.value
        c = self.compress_speed.value or self.PRIOR_COMPRESS_GBPS * 1e9
        d = self.decompress_speed.value or self.PRIOR_DECOMPRESS_GBPS * 1e9

        def make(compress: bool, reason: str) -> Decision:
            return Decision(compress, reason, nbytes, probe_ratio, link and link / 1e9, c / 1e9, d / 1e9)

        if self.mode == "on":
            return make(True, "forced on")
        if self.mode == "off":
            return make(False, "forced off")
        if nbytes < self.MIN_BYTES:
            return make(False, "small chunk")
        zip_seen, raw_seen = self._outcomes(transfer_bytes)
        measured = self._measured(transfer_bytes, zip_seen, raw_seen)
        if measured is not None and not measured[0]:
            return make(False, measured[1])
        if link is None:
            return make(False, "link speed not measured yet")
        if probe_ratio is None:
            return make(False, "codec slower than the link")
        if probe_ratio > 1 - self.MARGIN:
            return make(False, "incompressible")
        t_raw = nbytes / link
        t_zip = max(nbytes / c, nbytes * probe_ratio / link, nbytes / d)
        if chunks_in_transfer:
            # n chunks cost n x the slowest stage + fill + drain; per chunk, that share of it.
            # A two-chunk 1.26 MB PP step measured 1.24x raw compressed where the model without
            # this term predicted 0.7x.
            t_zip += (nbytes / c + nbytes / d) / chunks_in_transfer
        if measured is not None:  # both paths measured, compression the faster (and this chunk compressible)
            return make(True, measured[1])
        # One path measured for transfers of this size: its outcome replaces the model's guess.
        src = "model"
        if zip_seen is not None:
            src, t_zip = "measured compressed", nbytes * zip_seen
        elif raw_seen is not None:
            src, t_raw = "measured raw", nbytes * raw_seen
        return make(t_zip < (1 - self.MARGIN) * t_raw, f"{src}: {t_zip * 1e3:.1f} ms compressed vs {t_raw * 1e3:.1f} ms raw")


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
