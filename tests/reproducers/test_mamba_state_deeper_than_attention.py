"""Reproducers: a Mamba hybrid with a KV connector never skips tokens whose
attention KV is gone, nor starts where it has no Mamba state.

With a connector on a Mamba hybrid the scheduler looks up each KV cache
group's prefix hit on its own, and 0.24.0-0.26.0 tell the connector the
deepest of them as the local hit. Block pressure can evict a prompt's last
attention blocks from the GPU prefix cache while its Mamba state block
stays: the Mamba group then hits the whole prompt, full attention only its
first blocks, and the request is admitted as if the whole prompt were
computed. The connector loads nothing (the local hit already covers what
it holds), nobody computes the evicted blocks' tokens, and the request
attends to attention blocks that hold zeros, with no error
(vllm-project/vllm#46453, fixed by #48425 in 0.27.0). The fake model
runner checks the content of every block a step reads.

The other direction: block pressure evicts a prompt's Mamba state block
while its attention blocks stay cached. 0.24.0-0.26.0 (with 0013 as
without it) take full attention's hit, and where the connector loads
nothing past it (SimpleCPUOffload holds nothing there), the request starts
at that hit reading a Mamba state no block holds: wrong output, no error.
0.27.0 falls back to the hit every group holds (#48425's
get_computed_blocks_for_connector).
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from harness.burst import count_calls
from harness.engine import Engine, HarnessConfig
from harness.mamba import (
    attention_evicted_past_the_mamba_state,
    mamba_engine,
    mamba_state_evicted_under_the_attention,
    skip_where_a_load_is_refused,
)
from harness.offload_checks import first_chunk_and_loads

EXTENSION = list(range(900, 917))


def _extended_and_recorded(e: Engine, prompt: list[int]) -> tuple[str, tuple]:
    """Add a request extending `prompt` and take one step: the request, and
    the prefix-cache statistics the step added (requests, hits, preempted
    requests)."""
    stats = e.scheduler.kv_cache_manager.prefix_cache_stats
    before = (stats.requests, stats.hits, stats.preempted_requests)
    req_id = e.add_request(prompt + EXTENSION, max_tokens=2)
    e.step()
    after = (stats.requests, stats.hits, stats.preempted_requests)
    return req_id, tuple(a - b for a, b in zip(after, before, strict=True))


def test_a_prompt_whose_last_attention_blocks_were_evicted_is_not_skipped():
    e = mamba_engine("align")
    prompt = list(range(100, 164))  # four blocks of 16
    attention_evicted_past_the_mamba_state(e, prompt, kept_blocks=2)
    e.add_request(prompt + EXTENSION, max_tokens=2)
    # 0.19.0-0.22.1 refuse a connector's load with an align group (ledger
    # row mamba-align-external-hit-assert): a skip.
    with skip_where_a_load_is_refused("align"):
        e.run()
    read_wrong = "\n".join(str(v) for v in e.runner.violations)
    assert not read_wrong, f"the extension read blocks nobody wrote:\n{read_wrong}"


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_prompt_whose_mamba_state_was_evicted_starts_where_a_state_is(lazy):
    e = mamba_engine("align", lazy=lazy, log_stats=True)
    prompt = list(range(100, 164))  # four blocks of 16
    mamba_state_evicted_under_the_attention(e, prompt)
    with skip_where_a_load_is_refused("align"):
        req_id, recorded = _extended_and_recorded(e, prompt)
        e.run()
    read_wrong = "\n".join(str(v) for v in e.runner.violations)
    assert not read_wrong, f"the extension read a state nobody wrote:\n{read_wrong}"
    assert req_id in e.stats.finished
    # Its local lookup is recorded once, with the hit it took (none).
    assert recorded == (1, 0, 0)


def test_a_load_past_the_attention_hit_brings_the_state():
    """The hits diverge (full attention 64, Mamba none) and the CPU holds
    the prompt past full attention's hit: the connector loads 64-80 and the
    Mamba state at 80, and the request starts there, as on every release
    from 0.24.0 (a fallback to the common hit whatever the connector
    found would read blocks loaded for another start). Eager mode: its
    stores hold the whole prompt on the CPU."""
    e = mamba_engine("align")
    prompt = list(range(100, 180))  # five blocks of 16
    mamba_state_evicted_under_the_attention(e, prompt, attention_kept=4)
    req_id = e.add_request(prompt + EXTENSION, max_tokens=2)
    with skip_where_a_load_is_refused("align"):
        (_, start, _), _ = first_chunk_and_loads(e, req_id)
    read_wrong = "\n".join(str(v) for v in e.runner.violations)
    assert not read_wrong, f"the extension read blocks nobody wrote:\n{read_wrong}"
    assert req_id in e.stats.finished
    # Only a load of 64-80 with its state starts the request at 80.
    assert start == 80


@pytest.mark.parametrize("layout", ["attention-only", "diverged-load"])
def test_each_local_lookup_is_recorded_once(layout):
    """The prefix-cache statistics count a request's local lookup once,
    with the hit it keeps: full attention's where the connector loads past
    it on diverged hits, and the plain lookup's without a Mamba group."""
    prompt = list(range(100, 180))  # five blocks of 16
    if layout == "attention-only":
        e = Engine(HarnessConfig(log_stats=True))
        e.add_request(prompt, max_tokens=3)
        e.run()
    else:
        e = mamba_engine("align", log_stats=True)
        mamba_state_evicted_under_the_attention(e, prompt, attention_kept=4)
    with skip_where_a_load_is_refused("align"):
        _, recorded = _extended_and_recorded(e, prompt)
    kept = 80 if layout == "attention-only" else _hit_kept_where_a_load_passes(e)
    assert recorded == (1, kept, 0)


def _hit_kept_where_a_load_passes(e: Engine) -> int:
    """The local hit a request keeps on diverged hits (full attention 64,
    Mamba none) where the connector loads past them."""
    coordinator = e.scheduler.kv_cache_manager.coordinator
    if hasattr(coordinator, "find_longest_cache_hit_per_group"):
        return 64  # full attention's hit, which the connector loads past
    return 0  # before 0.24.0: the hit every group holds, none


def test_a_preempted_request_s_diverged_hit_is_recorded_as_preempted():
    """A request preempted once, whose hits diverged again while it waited
    (its Mamba state evicted, its first four attention blocks kept) and
    whose connector loads past them: its lookup is recorded once, among the
    preempted requests' (vLLM's statistics keep a resumed request's hits
    apart from new requests')."""
    e = mamba_engine("align", log_stats=True)
    prompt = list(range(100, 180))  # five blocks of 16
    mamba_state_evicted_under_the_attention(e, prompt, attention_kept=4)
    req_id = e.add_request(prompt + EXTENSION, max_tokens=8)
    s = e.scheduler
    request = s.requests[req_id]
    with skip_where_a_load_is_refused("align"):
        while request.status != RequestStatus.RUNNING:
            e.step()
    block_ids = s.kv_cache_manager.get_block_ids(req_id)
    # Preempted as the scheduler does: out of the running queue, then back
    # to waiting with its blocks freed (and cached).
    s.running.remove(request)
    s._preempt_request(request, time.monotonic())
    for ids, keep in zip(block_ids, (4, 0), strict=True):
        for block_id in ids[keep:]:
            e.block_pool._maybe_evict_cached_block(e.block_pool.blocks[block_id])
    stats = s.kv_cache_manager.prefix_cache_stats
    before = (stats.requests, stats.preempted_requests, stats.preempted_hits)
    e.step()
    after = (stats.requests, stats.preempted_requests, stats.preempted_hits)
    recorded = tuple(a - b for a, b in zip(after, before, strict=True))
    assert recorded == (0, 1, _hit_kept_where_a_load_passes(e))
    e.run()
    assert req_id in e.stats.finished
    read_wrong = "\n".join(str(v) for v in e.runner.violations)
    assert not read_wrong, f"the resumed request read unwritten blocks:\n{read_wrong}"


def test_hits_that_agree_are_looked_up_once():
    """Where every group hits as deep as full attention (here the whole
    prompt, cached in both groups), one lookup decides the hit: no second
    lookup for the hit every group holds, which would be the same hit at
    twice the cost per admission (and, on 0.24.0, drop the per-group
    path's Marconi hint). Counted at the coordinator, under whichever
    lookup each release's scheduler makes."""
    e = mamba_engine("align")
    prompt = list(range(100, 180))  # five blocks of 16
    e.add_request(prompt, max_tokens=2)
    with skip_where_a_load_is_refused("align"):
        e.run()
    coordinator = e.scheduler.kv_cache_manager.coordinator
    names = ("find_longest_cache_hit", "find_longest_cache_hit_per_group")
    lookups = {name: 0 for name in names if hasattr(coordinator, name)}
    for name in lookups:
        count_calls(coordinator, name, lookups)
    req_id = e.add_request(prompt + EXTENSION, max_tokens=2)
    e.run()
    assert req_id in e.stats.finished
    assert sum(lookups.values()) == 1, lookups
