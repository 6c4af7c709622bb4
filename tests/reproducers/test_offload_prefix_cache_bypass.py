"""Reproducers: a request that skips reading the prefix cache computes its
whole prompt, with SimpleCPUOffload too (ledger rows
offload-ignores-prefix-cache-bypass and hybrid-connector-lookup-ignores-bypass).

A request asking for prompt logprobs (or a pooling request over every
token) is marked `skip_reading_prefix_cache`: a prefix served from a cache
has no logits or hidden states, so the engine must compute every prompt
token. The KV cache manager's own lookup honours the mark on every release.
SimpleCPUOffload's lookup ignores it up to 0.29.0 (vllm-project/vllm#54998,
fixed in 0.30.0): the request loads its prefix from the CPU and computes
only the rest, and its prompt logprobs come back short, their indices off
the prompt's positions (vllm#44585 reports the same of the generic
OffloadingConnector). On a Mamba hybrid with a connector, 0.24.0-0.26.0's
scheduler also takes each group's local hit without looking at the mark
(0.27.0's get_computed_blocks_for_connector checks it first): the request
starts at its GPU prefix hit.

The check is where the request's first chunk starts: at token 0.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.mamba import PROMPT, mamba_engine, prompt_on_the_cpu_only
from harness.offload_checks import first_chunk_and_loads

# Past the cached prompt: a Mamba group holds its state at the prompt's end
# (48), which only a longer request can hit.
EXTENSION = list(range(900, 940))


def _engine(layout: str) -> Engine:
    if layout == "mamba-align":
        return mamba_engine("align")
    return Engine(HarnessConfig(num_gpu_blocks=32, num_cpu_blocks=32))


def _computes_its_whole_prompt(e: Engine) -> None:
    req_id = e.add_request(PROMPT + EXTENSION, max_tokens=2, prompt_logprobs=1)
    (_, start, _), loaded = first_chunk_and_loads(e, req_id)
    assert (start, loaded) == (0, set()), (
        f"a request asking for prompt logprobs started at token {start}, "
        f"loading GPU blocks {sorted(loaded)}"
    )
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []


@pytest.mark.parametrize("layout", ["full-attention", "mamba-align"])
def test_a_request_that_skips_the_prefix_cache_loads_nothing_from_the_cpu(layout):
    e = _engine(layout)
    prompt_on_the_cpu_only(e)
    _computes_its_whole_prompt(e)


def test_a_request_that_skips_the_prefix_cache_takes_no_local_hit_on_a_hybrid():
    """The prompt stays cached on the GPU (and on the CPU): neither tier
    may serve it."""
    e = mamba_engine("align")
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    _computes_its_whole_prompt(e)
