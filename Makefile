# The commands of the README (run, test, test-fast). Each sets up .venv itself (scripts/setup.sh) first.
PY := .venv/bin/python
# The suite runs on JOBS pytest processes (pytest-xdist; JOBS=0 runs it in this one), each
# test in the group that keeps what it shares on one process (tests/parallel.py).
JOBS ?= 2
PARALLEL := -n $(JOBS)

.PHONY: run demo test test-fast lint setup clean

run:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.launch $(ARGS)

demo:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.demo $(ARGS)

test:
	bash scripts/setup.sh dev vllm wandb ray
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PARALLEL) -m "not cluster" $(ARGS)

# The inner loop: every test not marked slow (no real multi-process run, no vLLM engine),
# within 3 minutes on 2 cores; `make test` stays what CI runs (docs/testing.md).
test-fast:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m pytest $(PARALLEL) -m "not slow" $(ARGS)

lint:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv runs outputs .pytest_cache .ruff_cache
