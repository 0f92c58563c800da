# make run   set up .venv and run the main job (BERT MLM in bf16)
# make test  set up .venv and run the test suite (CI runs this), all but the `slow` tests
# make test-slow  the `slow` tests: the real CLI in subprocesses (tests/e2e/), CI runs them too
# make sweep set up .venv and compare fp32, fp16 and bf16 side by side
# make docs  build the documentation site (docs/) strictly: a broken link or page fails
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run sweep test test-slow lint bench docs

setup:
	@bash scripts/setup.sh

run: setup
	@start=$$(date +%s); $(PY) -m runner precision=bf16 model=bert; status=$$?; \
	echo "make run: the main job took $$(( $$(date +%s) - start )) s"; exit $$status

sweep: setup
	$(PY) -m runner -m precision=fp32,fp16,bf16 model=bert

test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m slow

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(PY) scripts/bench.py

docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $${TMPDIR:-/tmp}/amp-runner-site
