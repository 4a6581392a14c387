"""The `uzip` command line.

    uzip info FRAME            what a frame file holds (dtype, shape, ratio)
    uzip info MODEL.safetensors [--tensors] [--json]   what uzip does to a checkpoint: every
                               tensor compressed, checked bit-exact, ratio per dtype, codec speed
    uzip bench codec [...]     CPU codec vs zstd/lz4/zipnn on real tensors
    uzip coordinator --listen HOST:PORT --state FILE [...]   the weight-push coordinator
    uzip disagg up --model DIR [...]   1 prefill + 1 decode vLLM instance and a proxy (UzipConnector)
    uzip version
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _bench(args: list[str]) -> int:
    # Benchmarks ship with the source tree, not the wheel: they need the real-data
    # preparation and the baseline codecs of the `bench` extra.
    root = _repo_root()
    if not (root / "benchmarks" / "__init__.py").exists():
        print("uzip bench needs a source checkout of uzip-serve (benchmarks/ is not installed)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    if not args or args[0] in ("-h", "--help"):
        print("usage: uzip bench {codec,disagg} [options]   (uzip bench codec --help)")
        return 0 if args else 2
    which, rest = args[0], args[1:]
    if which == "codec":
        from benchmarks import codec_cpu

        return codec_cpu.main(rest)
    if which == "disagg":
        from benchmarks import disagg_link

        return disagg_link.main(rest)
    print(f"uzip bench: unknown benchmark {which!r}; available: codec, disagg", file=sys.stderr)
    return 2


def _disagg(args: list[str]) -> int:
    # The vLLM integration is optional: imported only here.
    if not args or args[0] != "up":
        print("usage: uzip disagg up [--model DIR] [--port 8000] [--tp 1] [--compression auto|on|off] ...",
              file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        from uzip_vllm import disagg
    except ImportError as e:
        print(f"uzip disagg needs the vLLM integration (pip install -e integrations/vllm): {e}", file=sys.stderr)
        return 2
    return disagg.main(args[1:])


def _info(path: str, per_tensor: bool = False, as_json: bool = False) -> int:
    if path.endswith(".safetensors"):
        return _info_safetensors(path, per_tensor, as_json)
    import uzip_serve as uz

    data = Path(path).read_bytes()
    try:
        h = uz.read_header(data)
    except uz.FrameError as e:
        print(f"{path}: not a valid uzip frame: {e}", file=sys.stderr)
        return 1
    print(f"{path}: uzip frame v{uz.FORMAT_VERSION}, {h.dtype.name} {list(h.shape)}, "
          f"{h.nbytes} -> {h.frame_nbytes} bytes (ratio {h.ratio:.4f}), {h.num_blocks} blocks of "
          f"{h.block_elems} elements")
    return 0


def _info_safetensors(path: str, per_tensor: bool, as_json: bool) -> int:
    """Compresses every tensor of a checkpoint on the CPU, decodes it again and compares the
    bits: the ratio a weight push of this checkpoint would see, per dtype and in all."""
    import json
    import time

    import torch

    import uzip_serve as uz
    from uzip_serve.codec import _dtype_name, default_threads

    try:
        from safetensors import safe_open
    except ImportError:
        print("uzip info on a .safetensors file needs the safetensors package (pip install safetensors)",
              file=sys.stderr)
        return 2
    tensors = []
    seconds = [0.0, 0.0]
    buf = bytearray()
    try:
        f = safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        print(f"{path}: not a readable safetensors file: {e}", file=sys.stderr)
        return 1
    with f:
        for name in f.keys():
            t = f.get_tensor(name)
            need = uz.max_compressed_size(t.nbytes, t.dtype)
            if len(buf) < need:  # reused, as a weight push reuses its buffers: time the codec, not page faults
                buf = bytearray(need)
            back = torch.empty_like(t)
            t0 = time.perf_counter()
            n = uz.compress_into(t, buf)
            t1 = time.perf_counter()
            frame = memoryview(buf)[:n]
            uz.decompress(frame, out=back)
            seconds[0] += t1 - t0
            seconds[1] += time.perf_counter() - t1
            if back.dtype != t.dtype or back.shape != t.shape or not torch.equal(
                    back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                print(f"{path}: tensor {name!r} did not round-trip bit-exactly; please report this", file=sys.stderr)
                return 1
            tensors.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "bytes": t.nbytes,
                            "frame_bytes": len(frame)})
    totals: dict[str, list[int]] = {}  # dtype -> [tensors, raw bytes, frame bytes]
    for r in tensors:
        row = totals.setdefault(r["dtype"], [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + r["bytes"], row[2] + r["frame_bytes"]
    raw = sum(r["bytes"] for r in tensors)
    wire = sum(r["frame_bytes"] for r in tensors)
    speed = {"threads": default_threads(),
             "compress_gb_s": raw / seconds[0] / 1e9 if seconds[0] else None,
             "decompress_gb_s": raw / seconds[1] / 1e9 if seconds[1] else None}
    if as_json:
        print(json.dumps({"file": path, "bytes": raw, "frame_bytes": wire, "bit_exact": True,
                          "dtypes": {k: dict(zip(("tensors", "bytes", "frame_bytes"), v)) for k, v in totals.items()},
                          "codec": speed, **({"tensors": tensors} if per_tensor else {})}, indent=1))
        return 0
    print(f"{path}: {len(tensors)} tensors, {raw / 1e6:.1f} MB; every tensor round-tripped bit-exactly")
    if per_tensor:
        for r in tensors:
            print(f"  {r['name']:<60} {r['dtype']:<14} {str(r['shape']):<18} {r['bytes'] / 1e6:9.3f} MB  "
                  f"{r['frame_bytes'] / max(r['bytes'], 1):.4f}")
    print(f"{'dtype':<16}{'tensors':>8}{'MB raw':>11}{'MB uzip':>11}{'ratio':>8}")
    for dtype, (n, b, fb) in sorted(totals.items(), key=lambda kv: -kv[1][1]) + [("all", [len(tensors), raw, wire])]:
        print(f"{dtype:<16}{n:>8}{b / 1e6:>11.1f}{fb / 1e6:>11.1f}{fb / max(b, 1):>8.4f}")
    if seconds[0] and seconds[1]:
        print(f"codec on this host ({speed['threads']} threads, CPU): compress {speed['compress_gb_s']:.2f} GB/s, "
              f"decompress {speed['decompress_gb_s']:.2f} GB/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="uzip", description="uzip-serve: lossless tensor compression")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the package and format versions")
    p_info = sub.add_parser("info", help="describe a frame file, or what uzip does to a .safetensors checkpoint")
    p_info.add_argument("frame", help="a uzip frame file, or a .safetensors file")
    p_info.add_argument("--tensors", action="store_true", help=".safetensors: a line per tensor")
    p_info.add_argument("--json", action="store_true", help=".safetensors: print JSON")
    sub.add_parser("bench", help="run a benchmark (uzip bench codec --help)", add_help=False)
    sub.add_parser("coordinator", help="run the weight-push coordinator (uzip coordinator --help)",
                   add_help=False)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    sub.add_parser("disagg", help="disaggregated prefill/decode with vLLM (uzip disagg up --help)",
                   add_help=False)
    if argv and argv[0] == "disagg":
        return _disagg(argv[1:])
    if argv and argv[0] == "coordinator":
        from uzip_serve.coordinator import server

        return server.main(argv[1:])
    args = parser.parse_args(argv)
    if args.cmd == "version":
        import uzip_serve as uz

        print(f"uzip-serve {uz.__version__}, frame format v{uz.FORMAT_VERSION}")
        return 0
    if args.cmd == "info":
        return _info(args.frame, args.tensors, args.json)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
