# vllm-fork: a tested patch series on a pinned upstream vLLM.
# Run `make help` for the targets. Python 3.11+ and git are all it needs
# to start; everything else is installed into .venv.

PYTHON ?= python3
SERIES ?= patches
TREE ?= vllm
# Extra arguments for a script, e.g. make export ARGS="--onto main"
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help fetch apply refresh install venv test test-slow bench wheel \
	overlay export import soak clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  Variables: SERIES=$(SERIES) TREE=$(TREE) PYTHON=$(PYTHON)"

fetch: ## download and verify the pinned upstream base, import it into .cache/
	$(PYTHON) scripts/fetch.py --series $(SERIES)

apply: venv ## build vllm/: upstream base + patches + overlay (idempotent)
	$(PYTHON) scripts/apply.py --series $(SERIES) --tree $(TREE)

refresh: ## write patches/ back from the commits in vllm/
	$(PYTHON) scripts/refresh.py --series $(SERIES) --tree $(TREE)

install: apply ## pip install -e vllm into .venv with this machine's variables
	$(PYTHON) scripts/install.py --tree $(TREE)

venv: ## create .venv with torch and vLLM's build requirements
	@$(PYTHON) scripts/venv.py build >/dev/null

test: ## tooling tests, upstream tests on base and series, reproducers, lint
	$(PYTHON) scripts/run_tests.py

test-slow: ## slow tests: upstream's real wheel repacked, installed and tested
	$(PYTHON) scripts/run_tests.py --slow

wheel: ## patched wheel from upstream's released one, into dist/
	$(PYTHON) scripts/repack.py --series $(SERIES) $(ARGS)

overlay: ## container build context over upstream's image, into dist/
	$(PYTHON) scripts/container.py --series $(SERIES) $(ARGS)

export: apply ## a branch, .patch and PR text per patch for upstream (ARGS=--onto/--upstream)
	$(PYTHON) scripts/export.py --series $(SERIES) --tree $(TREE) $(ARGS)

import: ## add an upstream fix as the next patch (ARGS="--repo CLONE RANGE" or ARGS=FILE)
	$(PYTHON) scripts/import_patch.py --series $(SERIES) $(ARGS)

bench: ## allocator speed: unpatched base against the series, side by side
	$(PYTHON) scripts/bench.py --series $(SERIES)

soak: ## load, fault and fuzz campaign: base and series side by side (ARGS=--vary)
	$(PYTHON) scripts/soak.py --series $(SERIES) $(ARGS)

clean: ## remove generated work trees and logs (keeps vllm/, .venv, .cache)
	rm -rf .work
