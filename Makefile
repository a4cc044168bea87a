# The two commands of the README (run, test). Each sets up .venv itself (scripts/setup.sh) first.
PY := .venv/bin/python

.PHONY: run demo test lint setup clean

run:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.launch $(ARGS)

demo:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.demo $(ARGS)

test:
	bash scripts/setup.sh dev vllm wandb
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(ARGS)

lint:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv runs outputs .pytest_cache .ruff_cache
