# The commands of the README (run, test, test-fast). Each sets up .venv itself (scripts/setup.sh) first.
PY := .venv/bin/python

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
	$(PY) -m pytest $(ARGS)

# The inner loop: every test not marked slow (no real multi-process run, no vLLM engine),
# within 3 minutes on 2 cores; `make test` stays what CI runs (docs/testing.md).
test-fast:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow" $(ARGS)

lint:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv runs outputs .pytest_cache .ruff_cache
