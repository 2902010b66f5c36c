# loadplan: the two README commands are `make demo` and `make test`.
# Both create or reuse .venv, install the project and build the protobuf code.
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO := proto/loadplan/v1/registry.proto
GEN := gen/loadplan/v1/registry_pb2.py

.PHONY: setup proto test demo clean

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

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

demo: setup
	$(VENV)/bin/loadplan demo

clean:
	rm -rf gen build *.egg-info
