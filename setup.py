"""Builds the C extensions (the CPU codec, the P2P spin-wait); all other metadata lives in
pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "uzip_serve.kernels._cpu_codec",
            sources=["uzip_serve/kernels/cpu_codec.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-fno-strict-aliasing"],
            extra_link_args=["-lpthread"],
        ),
        # The GIL-free wait of a caller for a same-host GPU transfer (p2p/loop.py).
        Extension("uzip_serve.p2p._spin", sources=["uzip_serve/p2p/spin_wait.c"],
                  extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"]),
    ]
)
