# vllm-fork: a tested patch series on a pinned upstream vLLM.
# Run `make help` for the targets. Python 3.11+ and git are all it needs
# to start; everything else is installed into .venv.

PYTHON ?= python3
SERIES ?= patches
TREE ?= vllm
# Extra arguments for a script, e.g. make export ARGS="--onto main"
ARGS ?=
# make apply/install/refresh/wheel/overlay/image VERSION=0.28.0: that
# release's series (patches/v0.28.0/, or patches/ for its own release).
# Without VERSION= or SERIES=, the series $(TREE)/ was built from: a release
# chosen once (make apply VERSION=0.28.0) holds until another is chosen
# (scripts/keep/tree_release.py --pick; patches/ when there is no tree).
# (make rebase reads VERSION as the version a git ref stands for.)
# Only a VERSION given on the command line: one exported for another tool
# must not switch the series silently.
VERSION_ASKED = $(filter command line,$(origin VERSION))
PICK = $(if $(VERSION_ASKED),--version $(VERSION),$(if $(filter command line environment,$(origin SERIES)),--series $(SERIES),$(shell $(PYTHON) scripts/keep/tree_release.py --pick --tree $(TREE))))

.DEFAULT_GOAL := help
.PHONY: help fetch apply refresh install venv test test-releases test-slow bench rebase \
	rebase-continue rebase-abort matrix wheel overlay image export import soak differential \
	mutate e2e clean standin upstream-cut bisect-upstream canary ledger test-gpu

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z0-9-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  Variables: VERSION=<release> (default: the one $(TREE)/ holds) SERIES=$(SERIES) TREE=$(TREE) PYTHON=$(PYTHON)"
	@echo "  make rebase: BASE=<release or git ref> [INTO=patches/v<release>] [VERSION= GIT_URL= EDIT=<patch number>]"

fetch: ## download and verify the pinned upstream base, import it into .cache/
	$(PYTHON) scripts/keep/fetch.py $(PICK)

apply: venv ## build vllm/: upstream base + patches + overlay (idempotent; VERSION=<release>)
	$(PYTHON) scripts/keep/apply.py $(PICK) --tree $(TREE)

refresh: ## write patches/ back from the commits in vllm/ (VERSION=<release>: its series)
	$(PYTHON) scripts/keep/refresh.py $(PICK) --tree $(TREE)

install: apply ## pip install -e vllm into .venv with this machine's variables (VERSION=<release>)
	$(PYTHON) scripts/ship/install.py --tree $(TREE)

venv: ## create .venv with torch and vLLM's build requirements
	@$(PYTHON) scripts/lib/venv.py build >/dev/null

test: ## tooling tests, upstream tests on base and series, reproducers, lint
	$(PYTHON) scripts/prove/run_tests.py $(ARGS)

test-releases: ## every release's series: reproducers and upstream tests, base against series (RELEASES=0.19.0,0.28.0; VERSION=0.28.0 for one)
	$(PYTHON) scripts/prove/test_releases.py $(if $(RELEASES),--releases $(RELEASES),$(if $(VERSION_ASKED),--releases $(VERSION)))

test-slow: ## slow tests: the real 0.20.2 -> 0.33.0 rebase; upstream's wheel repacked; make image
	$(PYTHON) scripts/prove/run_tests.py --slow

test-gpu: ## the copy-vs-compute races on a real GPU, base against series (one line and exit 0 without CUDA; ARGS=--bundle writes what a GPU machine needs)
	$(PYTHON) scripts/prove/test_gpu.py $(ARGS)

wheel: ## patched wheel from upstream's released one, into dist/
	$(PYTHON) scripts/ship/repack.py $(PICK) $(ARGS)

overlay: ## container build context over upstream's image, into dist/
	$(PYTHON) scripts/ship/container.py $(PICK) $(ARGS)

image: venv ## build make overlay's context with podman on a local stand-in for upstream's image; reproducers run inside (VERSION=<release>)
	$(PYTHON) scripts/ship/image.py $(PICK) $(ARGS)

export: ## the newest series as upstream PRs: branch, .patch, PR text, vLLM's checks (ARGS=--onto/--upstream; VERSION= another series)
	$(PYTHON) scripts/ship/export.py $(if $(VERSION_ASKED),--version $(VERSION)) $(ARGS)

import: ## add an upstream fix as the next patch (ARGS="--repo CLONE RANGE" or ARGS=FILE)
	$(PYTHON) scripts/keep/import_patch.py --series $(SERIES) $(ARGS)

rebase: ## move the series onto another release: make rebase BASE=0.33.0
	@test -n "$(BASE)" || { echo "usage: make rebase BASE=<release or git ref> [INTO=dir]"; exit 2; }
	$(PYTHON) scripts/keep/rebase.py --base $(BASE) --tree $(TREE) \
		$(if $(filter command line environment,$(origin SERIES)),--series $(SERIES)) \
		$(if $(INTO),--into $(INTO)) $(if $(VERSION),--version $(VERSION)) \
		$(if $(GIT_URL),--git-url $(GIT_URL)) $(foreach e,$(EDIT),--edit $(e))

rebase-continue: ## go on with the rebase after resolving a conflict
	$(PYTHON) scripts/keep/rebase.py --continue --tree $(TREE)

rebase-abort: ## undo the rebase in progress (the tree as it was)
	$(PYTHON) scripts/keep/rebase.py --abort --tree $(TREE)

matrix: ## patches and reproducers on releases 0.19.0 .. 0.33.0 (.work/matrix/)
	$(PYTHON) scripts/keep/matrix.py --series $(SERIES) $(if $(RELEASES),--releases $(RELEASES))

ledger: ## write docs/ledger.md (the bug ledger) and print each bug's standing per release (RELEASES=; default all)
	$(PYTHON) scripts/keep/ledger.py --releases $(or $(RELEASES),all)

standin: ## a linear stand-in for upstream's history from the release sdists (.work/upstream/standin.git)
	$(PYTHON) scripts/keep/standin.py

upstream-cut: venv ## upstream's history cut to what the reproducers need, by git filter-repo (UPSTREAM=<clone or URL>; default the stand-in)
	$(PYTHON) scripts/keep/upstream_cut.py $(if $(UPSTREAM),--upstream $(UPSTREAM)) $(ARGS)

bisect-upstream: ## the upstream commit that fixed a patch's bug, on the cut history: make bisect-upstream PATCH=0008
	@test -n "$(PATCH)" || { echo "usage: make bisect-upstream PATCH=<number> [SERIES=patches/v<release>]"; exit 2; }
	$(PYTHON) scripts/keep/bisect_upstream.py --patch $(PATCH) --series $(SERIES)

canary: ## the newest series on upstream main: applies / redundant / conflicts per patch (UPSTREAM= REF=; default the stand-in's main)
	$(PYTHON) scripts/keep/canary.py $(if $(UPSTREAM),--upstream $(UPSTREAM)) $(if $(REF),--ref $(REF)) \
		$(if $(filter command line environment,$(origin SERIES)),--series $(SERIES)) $(ARGS)

bench: ## speed, base against series: allocator, scheduler at scale, vllm serve, on 0.20.2 and 0.33.0 (ARGS: --part, --only, --sizes, --rounds)
	$(PYTHON) scripts/prove/bench.py $(if $(filter command line environment,$(origin SERIES)),--series $(SERIES)) $(ARGS)

e2e: apply ## the real vllm serve on a CPU, base against series, via the openai client (.work/e2e/)
	$(PYTHON) scripts/prove/e2e.py $(if $(VERSION_ASKED),--release $(VERSION)) $(ARGS)

mutate: ## hunk reverts, operator mutants and hand-written semantic mutants must each fail a test (ARGS=--kinds=semantic; .work/mutate/)
	$(PYTHON) scripts/prove/mutate.py $(ARGS)

differential: ## the differential oracle: base and series step by step on generated traces (ARGS=--seeds N)
	$(PYTHON) scripts/prove/differential.py --series $(SERIES) $(ARGS)

soak: ## load, fault and fuzz campaign: base and series side by side (ARGS=--vary)
	$(PYTHON) scripts/prove/soak.py --series $(SERIES) $(ARGS)

clean: ## remove generated work trees and logs (keeps vllm/, .venv, .cache)
	rm -rf .work
