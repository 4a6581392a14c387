# `make demo` and `make test` both set up from nothing: a .venv, the package with its
# C codec built, and the real tensors (cached in .cache/, outside git).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.uzip-installed

.PHONY: setup data demo test bench clean

setup: $(STAMP) data

$(STAMP): pyproject.toml setup.py uzip_serve/kernels/cpu_codec.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch: asked for loosely, pip would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/python -m benchmarks.realdata

demo: setup
	$(BIN)/python -m benchmarks.codec_cpu --quick --max-mb 32 --repeats 1 --out .cache/demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m benchmarks.codec_cpu

clean:
	rm -rf build *.egg-info uzip_serve/kernels/*.so
