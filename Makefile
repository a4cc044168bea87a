# The commands of the README (run, test, test-fast, docs). Each sets up .venv itself (scripts/setup.sh) first.
PY := .venv/bin/python
# The suite runs on JOBS pytest processes (pytest-xdist; JOBS=0 runs it in this one), each
# test in the group that keeps what it shares on one process (tests/parallel.py).
JOBS ?= 2
PARALLEL := -n $(JOBS)

.PHONY: run demo test test-fast lint docs setup clean

run:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.launch $(ARGS)

demo:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.demo $(ARGS)

test:
	bash scripts/setup.sh dev vllm wandb ray docs
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PARALLEL) -m "not cluster" $(ARGS)

# The inner loop: every test not marked slow (no real multi-process run, no vLLM engine),
# within 3 minutes on 2 cores; `make test` stays what CI runs (docs/testing.md).
test-fast:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m pytest $(PARALLEL) -m "not slow" $(ARGS)

# The documentation site, from docs/ (mkdocs.yml): a broken link or a page left out of the
# navigation fails the build; open site/index.html.
docs:
	bash scripts/setup.sh dev docs
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

lint:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv runs outputs site .pytest_cache .ruff_cache
