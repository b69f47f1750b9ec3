# One virtual environment (.venv) for everything: the service, the SGLang 0.5.23 CPU stack the engine
# tests run against, and the dev tools. `make demo` and `make test` build it on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SITE = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

.PHONY: demo demo-sglang serve test lint fmt bench bench-sglang reliability env env-service env-sglang-0.5.20 clean

demo: env-service ## serve the sidecar fed by the built-in demo engine
	$(BIN)/r3-sidecar demo

demo-sglang: env ## the real path: SGLang 0.5.23 on CPU with the plugin, its sidecar, a few requests
	$(BIN)/python tests/e2e/demo_sglang.py

serve: env-service
	$(BIN)/r3-sidecar serve

test: env env-sglang-0.5.20 ## the whole suite, as CI runs it
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: env-service
	$(BIN)/ruff check .

fmt: env-service
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: env
	$(BIN)/python -m benchmarks.run

bench-sglang: env ## real SGLang servers, plugin vs upstream (~10 min): the "Real SGLang server" section of BENCHMARKS.md
	$(BIN)/python -m benchmarks.real_server

reliability: env
	$(BIN)/python -m pytest -q -m slow tests

env-service: $(VENV)/.service-stamp
env: $(VENV)/.service-stamp $(VENV)/.sglang-stamp

$(VENV)/.service-stamp: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# SGLang 0.5.23 pins a CUDA torch; on CPU we install the CPU build first and sglang without its deps,
# then the explicit list it needs (requirements/sglang-cpu.txt), then two .pth-loaded test shims: the
# torchvision schema shim, and the CPU server shim (inert unless R3_TEST_SGLANG_CPU=1; tests/e2e sets it).
$(VENV)/.sglang-stamp: $(VENV)/.service-stamp requirements/sglang-cpu.txt $(wildcard tests/sglang_cpu/_sglang_cpu_*_shim.py)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(BIN)/python -m pip install -q -r requirements/sglang-cpu.txt
	cp tests/sglang_cpu/_sglang_cpu_tv_shim.py tests/sglang_cpu/_sglang_cpu_server_shim.py $(SITE)/
	echo "import _sglang_cpu_tv_shim" > $(SITE)/_sglang_cpu_tv_shim.pth
	echo "import _sglang_cpu_server_shim" > $(SITE)/_sglang_cpu_server_shim.pth
	touch $@

# Older SGLangs, one venv each (.venv-sglang-<version>). 0.5.20 pins the torch 0.5.23 does (2.13.0), so its
# venv holds only sglang 0.5.20 (--no-deps) and sees .venv's site-packages, shims included, behind it.
SGLANG_0520 := .venv-sglang-0.5.20
env-sglang-0.5.20: $(SGLANG_0520)/.sglang-stamp
$(SGLANG_0520)/.sglang-stamp: $(VENV)/.sglang-stamp
	test -x $(SGLANG_0520)/bin/python || $(BIN)/python -m venv --without-pip $(SGLANG_0520)
	$(BIN)/python -m pip --python $(SGLANG_0520)/bin/python install -q --no-deps sglang==0.5.20
	echo "import site; site.addsitedir('$(abspath $(SITE))')" > \
	  $$($(SGLANG_0520)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_r3_base_venv.pth
	touch $@

clean:
	rm -rf $(VENV) .venv-sglang-* .pytest_cache .ruff_cache .hypothesis
