# loadplan: the two README commands are `make demo` and `make test`.
# Both create or reuse .venv, install the project and build the protobuf code.
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO := proto/loadplan/v1/registry.proto
GEN := gen/loadplan/v1/registry_pb2.py

.PHONY: setup proto test demo clean browser

setup: $(VENV)/.installed $(GEN)

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch: exactly the CPU wheel on local disk; any other spec pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q grpcio-tools
	$(PY) scripts/gen_proto.py
	$(PY) -m pip install -q -e '.[service,engine,dev]'
	touch $@

proto: $(GEN)

$(GEN): $(PROTO) scripts/gen_proto.py
	$(PY) scripts/gen_proto.py

# The web view's browser tests (tests/service/http) drive Debian's Chromium through the
# Playwright package; Playwright's own browser download is not used.
browser: setup
	$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q playwright
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "note: no chromium (apt-get install chromium as root); the browser tests are skipped"

test: setup browser
	$(PY) -m pytest -q -p no:cacheprovider

demo: setup
	$(VENV)/bin/loadplan demo

clean:
	rm -rf gen build *.egg-info
