# `make train` and `make test` do everything on a fresh machine: create .venv, install the
# pinned dependencies, build the C++ kernels once (rebuilt only when csrc/ changes), run.
VENV ?= .venv
PY := $(VENV)/bin/python
REQS := $(if $(GPU),requirements-cuda.txt,requirements.txt)
DEPS_STAMP := $(VENV)/.deps-$(REQS)
BUILD_STAMP := $(VENV)/.built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
ARGS ?=

.PHONY: install train test bench clean

install: $(BUILD_STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

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
	$(PY) -m pytest -n 2 $(ARGS)

bench: install
	$(PY) bench/embedding_step.py $(ARGS)

clean:
	rm -rf build *.egg-info embcache/_C*.so $(BUILD_STAMP)
