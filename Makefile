# The two commands of the README: `make demo` and `make test`. Each sets itself up on a fresh
# machine (a virtualenv in .venv with the pinned workflow stack and a CPU build of torch).

VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (the demo and the tests); on a GPU machine install the CUDA build of torch
# into the venv first, or pass TORCH="torch==<version>" — an importable torch is never replaced.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
export PATH := $(abspath $(VENV))/bin:$(PATH)
SNAKEMAKE := $(PY) -m snakemake
CORES ?= all

.PHONY: setup demo test lint dryrun report clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[model,test]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: setup
	$(SNAKEMAKE) --cores $(CORES)
	@echo ""
	@echo "Demo finished. Results: results/demo/ (shard outputs in results/demo/outputs/, live telemetry in results/demo/_progress/)"
	@echo "Demo target model: resources/demo-target/"
	@echo "Plan of what remains: $(SNAKEMAKE) -n"

test: setup
	$(PY) -m pytest -ra

lint: setup
	$(SNAKEMAKE) --lint
	$(VENV)/bin/snakefmt --check Snakefile rules/

dryrun: setup
	$(SNAKEMAKE) -n --quiet rules

clean:
	rm -rf results .snakemake report.html
