# The two commands of the README. Each sets up .venv itself (scripts/setup.sh) first.
PY := .venv/bin/python

.PHONY: demo test lint setup clean

demo:
	bash scripts/setup.sh dev
	$(PY) -m asyncfp8.demo $(ARGS)

test:
	bash scripts/setup.sh dev vllm
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(ARGS)

lint:
	bash scripts/setup.sh dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf .venv runs outputs .pytest_cache .ruff_cache
