"""Builds the C codec extension; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "uzip_serve.kernels._cpu_codec",
            sources=["uzip_serve/kernels/cpu_codec.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-fno-strict-aliasing"],
            extra_link_args=["-lpthread"],
        )
    ]
)
