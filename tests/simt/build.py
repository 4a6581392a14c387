"""Builds a CUDA kernel file for the SIMT emulator (simt_host.h) as a Python extension module.

    from simt.build import build           # tests/ is on sys.path under pytest
    sim = build("uzip_serve/kernels/my.cu", defines={"TPB": 256})
    sim.launch("my_kernel", grid, block, smem_bytes, (ptr, n))

The .so is cached under .cache/simt/, keyed by the preprocessed translation unit (so every
included file and define counts), the flags and the compiler; a test session that changes
nothing compiles nothing. UZSIM_ASAN=1 builds with AddressSanitizer (fiber switches are
annotated, so it works with the ucontext fibers); the process must then load the ASan runtime
first, and libstdc++ with it (else ASan cannot intercept the emulator's exceptions):

    UZSIM_ASAN=1 LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" \
        ASAN_OPTIONS=detect_leaks=0 python -m pytest -q tests/test_simt.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOST_HEADER = HERE / "simt_host.h"
GLUE = HERE / "simt_module.cpp"
FLAGS = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-DUZ_SIMT", "-Wno-unknown-pragmas",
         # every module keeps its own emulator and kernel registry, even with several loaded
         "-fvisibility=hidden"]
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]


class BuildError(RuntimeError):
    """The compiler failed (its output is the message), or the ASan runtime is missing."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\nfailed ({done.returncode}):\n{done.stderr}")
    return done


def _asan_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return "libasan" in maps.read()


def build(cu_path: str | Path, *, name: str = "uzsim_kernels", defines: dict | None = None,
          cache_dir: str | Path | None = None):
    """Compiles `cu_path` with the emulator and returns the imported module (launch, kernels,
    configure). `defines` become -D flags (a value of None: a bare -DNAME)."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler (g++, or $CXX) on PATH")
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"module name must be an identifier: {name!r}")
    cu = Path(cu_path).resolve()
    asan = os.environ.get("UZSIM_ASAN") == "1"
    flags = FLAGS + (ASAN_FLAGS if asan else []) + [
        "-include", str(HOST_HEADER), f"-I{sysconfig.get_paths()['include']}", f'-DUZSIM_SOURCE="{cu}"']
    flags += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]

    # The module name (and PyInit_ symbol) carries the key, so each build is its own module.
    preprocessed = _run([cxx, *flags, "-DUZSIM_MODULE=uzsim_module", "-E", str(GLUE)]).stdout
    version = _run([cxx, "--version"]).stdout
    key = hashlib.sha256("\0".join([version, *flags, preprocessed]).encode()).hexdigest()[:16]
    module_name = f"{name}_{key}"
    if module_name in sys.modules:
        return sys.modules[module_name]

    cache = Path(cache_dir) if cache_dir is not None else REPO / ".cache" / "simt"
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"{module_name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not so.exists():
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        _run([cxx, *flags, f"-DUZSIM_MODULE={module_name}", str(GLUE), "-o", str(tmp)])
        os.replace(tmp, so)  # atomic: a concurrent build of the same key is harmless
    if asan and not _asan_loaded():
        raise BuildError("UZSIM_ASAN=1: the ASan runtime must be loaded first; run Python with LD_PRELOAD="
                         "\"$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)\" "
                         "ASAN_OPTIONS=detect_leaks=0")

    spec = importlib.util.spec_from_file_location(module_name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module
