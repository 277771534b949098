# The two commands of the README: `make demo` and `make test`. Both install into $(VENV) first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test install install-test lint protos

$(VENV)/.installed: pyproject.toml cpu_ext/CMakeLists.txt $(wildcard cpu_ext/src/*)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/freetoken-jax generate --model demo --prompt "Once upon a time" --max-new-tokens 48
	$(PY) -m freetoken_jax.bench decode --preset demo --strategy offload hybrid naive --vram-gb 0.001 --gen-len 32

test: install-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

lint: install-test
	$(VENV)/bin/ruff check freetoken_jax pallas_kernels tests benchmarks

# Regenerate the committed gRPC stubs from proto/freetoken.proto (tests check they are current).
protos: install-test
	$(PY) -m grpc_tools.protoc -Ifreetoken_jax/server/pb=proto --python_out=. --grpc_python_out=. proto/freetoken.proto
