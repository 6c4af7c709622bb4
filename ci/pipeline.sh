#!/usr/bin/env bash
# The fork's pipeline, for your own CI: the same steps this project runs.
#
#   ci/pipeline.sh [STAGE...]     stages: apply install test (default: all),
#                                 and canary (not by default: nightly)
#
# Needs python3 (3.11+), git and make; everything else goes into .venv.
# Environment: SERIES (default patches), TREE (default vllm),
# TORCH_SPEC (default torch==2.13.0, the CPU build; `install` on a GPU
# machine uses the torch the base release pins instead). The canary:
# UPSTREAM (default upstream vLLM on GitHub) and REF (default main).
set -euo pipefail
cd "$(dirname "$0")/.."

SERIES=${SERIES:-patches}
TREE=${TREE:-vllm}

stage_apply()   { make apply SERIES="$SERIES" TREE="$TREE"; }
stage_install() { make install SERIES="$SERIES" TREE="$TREE"; }
stage_test()    { make test; }
stage_canary()  {
  make canary UPSTREAM="${UPSTREAM:-https://github.com/vllm-project/vllm.git}" \
    REF="${REF:-main}"
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(apply install test)
for stage in "${stages[@]}"; do
  case "$stage" in
    apply|install|test|canary) ;;
    *) echo "ci/pipeline.sh: unknown stage '$stage' (apply, install, test, canary)" >&2; exit 2 ;;
  esac
done
for stage in "${stages[@]}"; do
  echo "::group::$stage"
  start=$SECONDS
  "stage_$stage"
  echo "::endgroup::"
  echo "stage $stage done in $((SECONDS - start))s"
done
