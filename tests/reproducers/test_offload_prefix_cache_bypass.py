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

The check is where the request's first chunk starts: at token 0. Every
run also ends with no CPU block referenced (harness.end_state), which a
lookup that pinned a hit for a request that then loads nothing breaks.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.engine import Engine, HarnessConfig
from harness.mamba import PROMPT, mamba_engine, prompt_on_the_cpu_only
from harness.offload_checks import first_chunk_and_loads

# Past the cached prompt: a Mamba group holds its state at the prompt's end
# (48), which only a longer request can hit.
EXTENSION = list(range(900, 940))
# What marks a request: prompt logprobs (SamplingParams sets the mark for
# them), or the mark set by hand, as a client may.
PROMPT_LOGPROBS = {"prompt_logprobs": 1}
MARKED_BY_HAND = {"skip_reading_prefix_cache": True}


def _engine(layout: str, **overrides: Any) -> Engine:
    if layout == "mamba-align":
        return mamba_engine("align", **overrides)
    cfg = HarnessConfig(num_gpu_blocks=32, num_cpu_blocks=32, **overrides)
    return Engine(cfg)


def _computes_its_whole_prompt(e: Engine, sampling: dict[str, Any]) -> None:
    req_id = e.add_request(PROMPT + EXTENSION, max_tokens=2, sampling=sampling)
    (_, start, _), loaded = first_chunk_and_loads(e, req_id)
    assert (start, loaded) == (0, set()), (
        f"a request that skips reading the prefix cache started at token "
        f"{start}, loading GPU blocks {sorted(loaded)}"
    )
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []


@pytest.mark.parametrize("layout", ["full-attention", "mamba-align"])
def test_a_request_that_skips_the_prefix_cache_loads_nothing_from_the_cpu(layout):
    e = _engine(layout)
    prompt_on_the_cpu_only(e)
    _computes_its_whole_prompt(e, PROMPT_LOGPROBS)


def test_a_request_marked_by_hand_loads_nothing_from_the_cpu():
    e = _engine("full-attention")
    prompt_on_the_cpu_only(e)
    _computes_its_whole_prompt(e, MARKED_BY_HAND)


def test_a_request_that_skips_the_prefix_cache_takes_no_local_hit_on_a_hybrid(
    monkeypatch,
):
    """The prompt stays cached on the GPU (and on the CPU): neither tier
    may serve it, and no local lookup is counted for it, as without a
    connector."""
    from vllm.v1.metrics.stats import PrefixCacheStats

    e = _engine("mamba-align", log_stats=True)
    kv = e.scheduler.kv_cache_manager
    local_lookups: list[int] = []
    record = PrefixCacheStats.record

    def spy(self, num_tokens, *args, **kwargs):
        # The local lookups' statistics, not the connector's.
        if self is kv.prefix_cache_stats:
            local_lookups.append(num_tokens)
        record(self, num_tokens, *args, **kwargs)

    monkeypatch.setattr(PrefixCacheStats, "record", spy)
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    _computes_its_whole_prompt(e, PROMPT_LOGPROBS)
    assert local_lookups == [len(PROMPT)], "its local lookup was counted"
