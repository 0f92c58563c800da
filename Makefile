# make run   set up .venv and run the main job (BERT MLM in bf16)
# make test  set up .venv and run the test suite (CI runs this), all but the `slow` tests
# make test-slow  the `slow` tests: the real CLI in subprocesses (tests/e2e/), CI runs them too
# make test-cluster  the `cluster` tests on a one-node SLURM and a Ray head it starts here (scripts/cluster.sh, root) and stops after, pass or fail; CI too
# make sweep set up .venv and compare fp32, fp16 and bf16 side by side
# make docs  build the documentation site (docs/) strictly: a broken link or page fails
VENV ?= .venv
PY := $(VENV)/bin/python
CLUSTER_DIR ?= /tmp/amp-runner-cluster

.PHONY: setup run sweep test test-slow test-cluster lint bench docs

setup:
	@bash scripts/setup.sh

run: setup
	@start=$$(date +%s); $(PY) -m runner precision=bf16 model=bert; status=$$?; \
	echo "make run: the main job took $$(( $$(date +%s) - start )) s"; exit $$status

sweep: setup
	$(PY) -m runner -m precision=fp32,fp16,bf16 model=bert

test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not cluster"

test-slow: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "slow and not cluster"

test-cluster: setup
	@start=$$(date +%s); export CLUSTER_DIR=$(CLUSTER_DIR) VENV=$(VENV); was_up=""; \
	if bash scripts/cluster.sh status >/dev/null; then was_up=1; fi; \
	trap 'if [ -n "$$was_up" ]; then echo "the cluster was up before: left up"; else bash scripts/cluster.sh down; fi; \
	      echo "make test-cluster: took $$(( $$(date +%s) - start )) s"' EXIT; \
	trap 'exit 130' INT TERM; \
	bash scripts/cluster.sh up && set -a && . $(CLUSTER_DIR)/env && set +a && \
	$(PY) -m pytest -q -m cluster

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(PY) scripts/bench.py

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $${TMPDIR:-/tmp}/amp-runner-site
