# `make train` and `make test` do everything on a fresh machine: create .venv, install the
# pinned dependencies, build the C++ kernels once (rebuilt only when csrc/ changes), run.
VENV ?= .venv
PY := $(VENV)/bin/python
REQS := $(if $(GPU),requirements-cuda.txt,requirements.txt)
DEPS_STAMP := $(VENV)/.deps-$(REQS)
BUILD_STAMP := $(VENV)/.built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
ARGS ?=

.PHONY: install train test lint bench clean cuda-check gpu-check

install: $(BUILD_STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torchrec goes in with --no-deps: it names the CUDA fbgemm-gpu, which a CPU machine replaces
# by fbgemm-gpu-cpu; its other needs are in $(REQS).
$(DEPS_STAMP): $(REQS) | $(PY)
	$(PY) -m pip install -q -r $(REQS)
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(CSRC) setup.py pyproject.toml
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

train: install
	$(VENV)/bin/dlrm train $(ARGS)

test: install
	$(PY) -m pytest -n 2 --dist loadgroup $(ARGS)

# ruff (configured in pyproject.toml): lint and formatting, checked, never rewritten here.
lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Compile check of the CUDA kernels for sm_80 and sm_90 (CI has nvcc but no GPU; the tests run
# the same kernel source on the warp emulator), and a syntax check of their torch binding
# (a CPU torch lacks one generated c10/cuda header: an empty stand-in is put after torch's).
NVCC ?= $(or $(shell command -v nvcc),/usr/local/cuda/bin/nvcc)
CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/include/cuda_runtime.h),/usr/local/cuda,$(abspath $(dir $(realpath $(NVCC)))..))
CUDA_CHECK := build/cuda-check
cuda-check: $(DEPS_STAMP)
	@mkdir -p $(CUDA_CHECK)/stub/c10/cuda/impl
	$(NVCC) -c csrc/cuda/cache_cuda.cu -o $(CUDA_CHECK)/cache_cuda.o -Icsrc/include -std=c++20 -O3 \
		--fmad=false -Xcompiler -fPIC -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
	@echo '#pragma once' > $(CUDA_CHECK)/stub/c10/cuda/impl/cuda_cmake_macros.h
	$(CXX) -std=c++20 -fsyntax-only csrc/cuda/binding.cpp -Icsrc/include \
		$$($(PY) -c "from torch.utils.cpp_extension import include_paths as p; import sysconfig; print(' '.join('-I' + d for d in p() + [sysconfig.get_paths()['include']]))") \
		-I$(CUDA_CHECK)/stub -I$(CUDA_HOME)/include

# The one-call GPU check, on a CUDA machine whose Python has torch (not FBGEMM or TorchRec): it
# builds the kernels for the GPU present, runs the CUDA tests and compute-sanitizer, and writes
# logs and gpu_check.json into OUT (bench/gpu_check.py). Without CUDA it says so and exits 0.
# It uses the machine's own python3 and torch: nothing is installed.
OUT ?= gpu-check
gpu-check:
	python3 bench/gpu_check.py $(OUT)

bench: install
	$(PY) bench/embedding_step.py $(ARGS)

clean:
	rm -rf build *.egg-info embcache/_C*.so embcache/_cuda_emu*.so $(BUILD_STAMP)
