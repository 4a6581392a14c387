"""The `uzip` command line.

    uzip info FRAME            what a frame file holds (dtype, shape, ratio)
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


def _info(path: str) -> int:
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="uzip", description="uzip-serve: lossless tensor compression")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the package and format versions")
    p_info = sub.add_parser("info", help="describe a frame file")
    p_info.add_argument("frame")
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
        return _info(args.frame)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
