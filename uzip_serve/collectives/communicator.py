"""The ring communicator both backends share: path choice, calibration, counters.

A backend (gloo.py, cuda.py) supplies a transport, a codec and a native all-reduce;
this class decides per call which path runs and keeps every rank's decision equal.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Callable

from uzip_serve.collectives.adaptive import AdaptivePolicy, Measurements, RingConfig, human_bytes
from uzip_serve.collectives.base import SUM_DTYPE_NAMES, CollectiveError, CollectiveStats, Communicator
from uzip_serve.collectives.ring import HopCodec, RingEngine, Transport

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("uzip_serve.collectives")

# A native all-reduce of this size is timed to measure the link: large enough that a
# shaper's burst allowance or a NIC's first-packet latency does not flatter the link.
CALIBRATION_BYTES = 8 << 20
SAMPLE_BYTES = 2 << 20  # the caller's data coded to measure the codec and the ratio
RATIO_PROBE_BYTES = 512 << 10


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RingCommunicator(Communicator):
    """Compressed ring collectives with an adaptive fallback. Construct it on every
    rank of `group` with the same config.

    `native_all_reduce(tensor) -> tensor`, if given, replaces the group's own
    all-reduce as the fallback (vLLM can pass its communicator's). Calibration runs
    inside the first all-reduce big enough to consider compression: a few small
    collectives and about 10-100 ms on a slow link, once.
    """

    def __init__(self, group=None, *, config: RingConfig | None = None,
                 native_all_reduce: Callable[["torch.Tensor"], "torch.Tensor"] | None = None):
        super().__init__(group)
        self.config = config if config is not None else RingConfig.from_env()
        self._native_fn = native_all_reduce
        from uzip_serve import format as fmt

        self._engine = RingEngine(self._make_transport(), self.rank, self.world_size,
                                  dtype_code_of=lambda d: fmt.dtype_by_name(_dtype_name(d)).code,
                                  sub_chunk_bytes=self.config.sub_chunk_bytes,
                                  min_sub_chunk_bytes=self.config.min_sub_chunk_bytes)
        self.codec = self._make_codec()
        self.raw_codec = self._make_raw_codec()
        self.policy = AdaptivePolicy(self.config, self.world_size,
                                     lambda nbytes: self._engine.sub_bytes(nbytes // self.world_size))
        self._calls = 0
        self._logged: set[str] = set()
        logger.info("uzip ring communicator: rank %d of %d, %s, config %s", self.rank, self.world_size,
                    type(self).__name__, self.config)

    # ---- backend hooks ----

    def _make_transport(self) -> Transport:
        raise NotImplementedError

    def _make_codec(self) -> HopCodec:
        raise NotImplementedError

    def _make_raw_codec(self) -> HopCodec:
        raise NotImplementedError

    def _native_all_reduce(self, x: "torch.Tensor") -> "torch.Tensor":
        import torch.distributed as dist

        if self._native_fn is not None:
            return self._native_fn(x)
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _agree_max(self, values: list[float]) -> list[float]:
        """The elementwise maximum over ranks: one tiny all-reduce on the group."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._small_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist()

    def _small_device(self):
        return "cpu"

    # ---- the verbs ----

    def all_reduce(self, tensor: "torch.Tensor") -> "torch.Tensor":
        import torch

        x = self._check("all_reduce", tensor, sum_=True)
        if self.config.validate:
            self._validate("all_reduce", x)
        nbytes = x.numel() * x.element_size()
        dname = _dtype_name(x.dtype)
        path = self._choose(x, nbytes, dname)
        delta = CollectiveStats(calls=1)
        t0 = time.perf_counter()
        ratio = None
        if path == "copy":
            out = x.clone()
        elif path == "native":
            out = self._native_all_reduce(x)
            delta.native = 1
        else:
            out = torch.empty_like(x)
            st = self._engine.run(x.reshape(-1), out.reshape(-1), "rs+ag",
                                  self.codec if path == "compressed" else self.raw_codec)
            if path == "compressed":
                delta.compressed, delta.raw_bytes, delta.wire_bytes = 1, st.raw_bytes, st.wire_bytes
                ratio = st.wire_bytes / st.raw_bytes if st.raw_bytes else None
            else:
                delta.ring = 1
        seconds = time.perf_counter() - t0
        if path == "compressed":
            delta.seconds_compressed = seconds
        elif path == "native":
            delta.seconds_native = seconds
        if path in ("compressed", "native"):
            self.policy.observe(path, nbytes, dname, seconds, ratio)
        self._record(delta)
        self._calls += 1
        if self.config.resync_every and self._calls % self.config.resync_every == 0 and self.policy.m is not None:
            self._resync()
        return out

    def reduce_scatter(self, tensor: "torch.Tensor") -> "torch.Tensor":
        import torch

        x = self._check("reduce_scatter", tensor, sum_=True)
        self._check_splittable("reduce_scatter", x)
        if self.config.validate:
            self._validate("reduce_scatter", x)
        n = self.world_size
        if n == 1:
            return x.clone()
        chunk = x.numel() // n
        out = torch.empty_like(x).reshape(-1)
        self._engine.run(x.reshape(-1), out, "rs", self._codec_for(x), chunk_elems=chunk)
        return out[self.rank * chunk:(self.rank + 1) * chunk].clone().view(x.shape[0] // n, *x.shape[1:])

    def all_gather(self, tensor: "torch.Tensor") -> "torch.Tensor":
        import torch

        x = self._check("all_gather", tensor, sum_=False)
        if self.config.validate:
            self._validate("all_gather", x)
        n = self.world_size
        if n == 1:
            return x.clone()
        out = torch.empty((n * x.numel(),), dtype=x.dtype, device=x.device)
        self._engine.run(x.reshape(-1), out, "ag", self._codec_for(x))
        shape = (n * x.shape[0], *x.shape[1:]) if x.dim() else (n,)
        return out.view(shape)

    def close(self) -> None:
        self._engine.close()

    # ---- the decision ----

    def _codec_for(self, x: "torch.Tensor") -> HopCodec:
        """reduce_scatter / all_gather always use a ring; compressed when an all-reduce
        of the same size would be."""
        if self.config.compression == "on":
            return self.codec
        nbytes = x.numel() * x.element_size() * self.world_size
        if self.config.compression == "off" or nbytes < self.config.floor_bytes:
            return self.raw_codec
        dname = _dtype_name(x.dtype)
        self._ensure_measured(x, dname)
        return self.codec if nbytes >= self.policy.threshold(dname) else self.raw_codec

    def _choose(self, x: "torch.Tensor", nbytes: int, dname: str) -> str:
        if self.world_size == 1 or x.numel() == 0:
            return "copy"
        fallback = self.config.fallback
        if self.config.compression == "on":
            return "compressed"
        if self.config.compression == "off" or nbytes < self.config.floor_bytes:
            return fallback
        if self.config.min_bytes is not None:
            return "compressed" if nbytes >= self.config.min_bytes else fallback
        self._ensure_measured(x, dname)
        path = self.policy.choose(nbytes, dname)
        if path == "agree":  # every rank reaches this call of the size class's trial together
            agreed = self._agree_max(self.policy.trial_report(nbytes, dname))
            self.policy.settle(nbytes, dname, agreed)
            path = self.policy.choose(nbytes, dname)
            logger.info("uzip all-reduce (%s): %s %s near the break-even measured %.2f / %.2f of the model "
                        "(compressed / native) -> %s", type(self).__name__, human_bytes(nbytes), dname, *agreed, path)
        return "compressed" if path == "compressed" else fallback

    def _ensure_measured(self, x: "torch.Tensor", dname: str) -> None:
        if self.policy.m is None:
            self._calibrate(x)
        if dname not in self.policy.m.ratio:
            self.policy.m.ratio[dname] = self._agree_max([self._probe_ratio(x)])[0]
            self.policy.set_measurements(self.policy.m)
        if dname not in self._logged:
            self._logged.add(dname)
            logger.info("uzip all-reduce (%s): %s", type(self).__name__, self.policy.describe(dname))

    def _probe_ratio(self, x: "torch.Tensor") -> float:
        flat = x.reshape(-1)
        sample = flat[: max(1, RATIO_PROBE_BYTES // x.element_size())]
        buf = self.codec.empty_bytes(self.codec.max_nbytes(sample.numel(), sample.dtype))
        return self.codec.encode_into(sample, buf) / (sample.numel() * sample.element_size())

    def _calibrate(self, x: "torch.Tensor") -> None:
        """Measures the link (native all-reduce), the codec on this data (every rank at
        once, as in the ring) and the pipeline's per-hop cost; agrees on the maxima."""
        import torch

        dev = x.device
        n = self.world_size
        hops = 2 * (n - 1)

        def best(fn, repeats: int) -> float:
            ts = []
            for _ in range(repeats):
                self._sync(dev)
                t0 = time.perf_counter()
                fn()
                self._sync(dev)
                ts.append(time.perf_counter() - t0)
            return min(ts)

        tiny = torch.zeros(1, dtype=torch.float32, device=dev)
        self._native_all_reduce(tiny)  # connection warm-up
        lat = best(lambda: self._native_all_reduce(tiny), 3)
        if self.config.link_gbps:
            link = self.config.link_gbps * 1e9 / 8
        else:
            cal = torch.zeros(CALIBRATION_BYTES, dtype=torch.uint8, device=dev)
            big = best(lambda: self._native_all_reduce(cal), 2)
            link = hops / n * CALIBRATION_BYTES / max(big - lat, 1e-6)
        # The codec on the caller's data, all ranks coding at the same time.
        flat = x.reshape(-1)
        sample = flat[: max(1, SAMPLE_BYTES // x.element_size())]
        sample_bytes = sample.numel() * sample.element_size()
        self._agree_max([0.0])  # line the ranks up
        t_c, t_d, nbytes = math.inf, math.inf, 0
        tmp = torch.empty_like(sample)
        buf = self.codec.empty_bytes(self.codec.max_nbytes(sample.numel(), sample.dtype))
        for _ in range(4):  # the first pass pays for page faults in fresh buffers and cold caches
            t0 = time.perf_counter()
            nbytes = self.codec.encode_into(sample, buf)
            self._sync(dev)
            t1 = time.perf_counter()
            self.codec.decode(buf[:nbytes], tmp)
            torch.add(tmp, sample, out=tmp)
            self._sync(dev)
            t2 = time.perf_counter()
            t_c, t_d = min(t_c, t1 - t0), min(t_d, t2 - t1)
        ratio = nbytes / sample_bytes
        # The pipeline's fixed cost per hop: a compressed ring on one element per rank.
        one = torch.zeros(n, dtype=x.dtype, device=dev)
        out = torch.empty_like(one)
        hop = best(lambda: self._engine.run(one, out, "rs+ag", self.codec), 3) / hops
        lat, inv_link, inv_c, inv_d, hop, ratio = self._agree_max(
            [lat, 1 / link, t_c / sample_bytes, t_d / sample_bytes, hop, ratio])
        self.policy.set_measurements(Measurements(
            native_latency_s=lat, link_Bps=1 / inv_link, compress_Bps=1 / inv_c, decompress_Bps=1 / inv_d,
            hop_latency_s=hop, ratio={_dtype_name(x.dtype): ratio}))

    def _resync(self) -> None:
        """Every rank contributes what it observed since the last agreement; all adopt
        the maxima, so thresholds move in lockstep."""
        p = self.policy
        vec = [p.local_correction("compressed") or 0.0, p.local_correction("native") or 0.0]
        vec += [p.local_ratio.get(d, 0.0) for d in SUM_DTYPE_NAMES]
        agreed = self._agree_max(vec)
        m = p.m
        before = {d: p.threshold(d) for d in m.ratio}
        if agreed[0] > 0:
            m.correct_compressed = min(max(agreed[0], 0.5), 4.0)
        if agreed[1] > 0:
            m.correct_native = min(max(agreed[1], 0.5), 4.0)
        for d, r in zip(SUM_DTYPE_NAMES, agreed[2:]):
            if r > 0:
                m.ratio[d] = r
        p.set_measurements(m)
        for d in m.ratio:
            if p.threshold(d) != before.get(d):
                logger.info("uzip all-reduce (%s) re-agreed: %s", type(self).__name__, p.describe(d))

    def _validate(self, verb: str, x: "torch.Tensor") -> None:
        from uzip_serve import format as fmt

        code = fmt.dtype_by_name(_dtype_name(x.dtype)).code
        hi = self._agree_max([x.numel(), -x.numel(), code, -code])
        if hi[0] != -hi[1] or hi[2] != -hi[3]:
            raise CollectiveError(f"{verb}: ranks disagree on the input: element counts range over "
                                  f"[{int(-hi[1])}, {int(hi[0])}] and dtype codes over [{int(-hi[3])}, "
                                  f"{int(hi[2])}] (rank {self.rank} has {x.numel()} x {x.dtype})")

    @staticmethod
    def _sync(dev) -> None:
        if getattr(dev, "type", dev) == "cuda":
            import torch

            torch.cuda.synchronize(dev)
