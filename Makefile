# pagewalk — every target sets itself up: `make test`, `make serve`, `make bench`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
HOST    ?= 127.0.0.1
PORT    ?= 8000
MODEL   ?= tiny

.PHONY: setup test test-gpu serve bench bench-kernel lint clean soak

# With CUDA the venv sees the system's (user's) torch and pip never replaces it (torch>=2.4 is satisfied);
# without CUDA we install the CPU build first (torch 2.13.0 lies on this machine's disk).
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(if $(HAS_CUDA),--system-site-packages) $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(if $(HAS_CUDA),,$(VPY) -m pip install -q torch==2.13.0 || $(VPY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch)
	$(VPY) -m pip install -q -e '.[test,bench]'
	@touch $(STAMP)

setup: $(STAMP)

# two workers (pytest-xdist): the suite took 328-343 s against 599 s in one process on the 2-core CI-class box
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -n 2 -m "not gpu" --timeout=600 --hypothesis-profile=ci tests

test-gpu: $(STAMP)
	$(VPY) -m pytest -q -m gpu tests

serve: $(STAMP)
	$(VENV)/bin/pagewalk serve --model $(MODEL) --host $(HOST) --port $(PORT)

bench: bench-kernel

bench-kernel: $(STAMP)
	$(VPY) -m tools.kernel_bench

# a bounded mixed workload with hang-ups against the CPU server (tiny preset); SOAK_S seconds (default 300),
# SOAK_API_SERVERS its --api-server-count
SOAK_S ?= 300
SOAK_API_SERVERS ?= 1
soak: $(STAMP)
	$(VPY) -m tools.soak --duration $(SOAK_S) --api-server-count $(SOAK_API_SERVERS)

lint: $(STAMP)
	$(VPY) -m pip install -q ruff && $(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
