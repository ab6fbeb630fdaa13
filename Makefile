# The two commands of the README: `make demo` (main job) and `make test`. Both create .venv first.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check --constraint constraints.txt

.PHONY: setup lint test demo tune-demo bench ablate clean

setup: $(VENV)/.installed

# torch is installed on its own first, so that the torch 2.13.0 wheel pip finds then (the CPU one where the index
# offers it: constraints.txt pins the version, not the build) is the one kept; no later requirement reinstalls it.
$(VENV)/.installed: setup.cfg setup.py pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) --editable '.[dev]'
	touch $@

# ruff, configured in pyproject.toml: the linter, then the formatter's check (`ruff format .` formats).
lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

test: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=20

# CHATCHAT_ROOT defaults to ./chatchat-root; pass MODEL=DIR to use a trained PolicyBERT.
demo: setup
	$(BIN)/python -m chatchat_policybert.demo --root $${CHATCHAT_ROOT:-chatchat-root} $(if $(MODEL),--model $(MODEL))

# After `make demo`: the query tower trained on the shipped training questions (213, on 60 of the 80 documents), judged
# by 3-fold cross-fitting on Chatchat's search_docs, installed when better (no kb -r); prints before/after.
tune-demo: setup
	$(BIN)/chatchat-policybert tune --root $${CHATCHAT_ROOT:-chatchat-root} --kb WeiMingPolicies \
		--questions chatchat_policybert/data/policy_training_questions.jsonl \
		--corpus chatchat_policybert/data/policy_corpus/Policys_cleaned.csv

bench: setup
	$(BIN)/python bench/embed.py

ablate: setup
	$(BIN)/python -m training.ablate --out runs/ablate

clean:
	rm -rf $(VENV) build dist *.egg-info
