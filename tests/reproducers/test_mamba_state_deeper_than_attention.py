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

from collections.abc import Callable

import pytest
from vllm.v1.request import RequestStatus

from harness.burst import count_calls
from harness.engine import Engine, HarnessConfig
from harness.mamba import (
    attention_evicted_past_the_mamba_state,
    evict_cached_past,
    mamba_engine,
    mamba_state_evicted_under_the_attention,
    skip_where_a_load_is_refused,
)
from harness.offload_checks import first_chunk_and_loads

EXTENSION = list(range(900, 917))


def _recorded_over(e: Engine, act: Callable[[], object]) -> tuple[int, ...]:
    """What the prefix-cache statistics recorded while `act` ran: requests,
    hits, preempted requests, their hits."""
    stats = e.scheduler.kv_cache_manager.prefix_cache_stats
    fields = ("requests", "hits", "preempted_requests", "preempted_hits")
    before = [getattr(stats, f) for f in fields]
    act()
    return tuple(getattr(stats, f) - b for f, b in zip(fields, before, strict=True))


def _extended_and_recorded(e: Engine, prompt: list[int]) -> tuple[str, tuple]:
    """Add a request extending `prompt` and take one step: the request, and
    what the prefix-cache statistics recorded in that step."""
    req_id = e.add_request(prompt + EXTENSION, max_tokens=2)
    return req_id, _recorded_over(e, e.step)


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
    assert recorded == (1, 0, 0, 0)


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
    assert recorded == (1, kept, 0, 0)


def _hit_kept_where_a_load_passes(e: Engine) -> int:
    """The local hit a request keeps on diverged hits (full attention 64,
    Mamba none) where the connector loads past them: full attention's where
    the scheduler looks each group up on its own for this connector
    (0.24.0-0.27.1, any connector; from 0.28.0 only one that declares
    supports_divergent_local_hybrid_hits, as NIXL does and SimpleCPUOffload
    does not), else the hit every group holds (none)."""
    coordinator = e.scheduler.kv_cache_manager.coordinator
    per_group = hasattr(coordinator, "find_longest_cache_hit_per_group")
    connector = e.scheduler.connector
    declared = getattr(connector, "supports_divergent_local_hybrid_hits", True)
    return 64 if per_group and declared else 0


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
    request = e.scheduler.requests[req_id]
    with skip_where_a_load_is_refused("align"):
        for _ in range(10):  # its load, then its first chunk
            if request.status == RequestStatus.RUNNING:
                break
            e.step()
    assert request.status == RequestStatus.RUNNING
    block_ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)
    e.preempt(req_id)
    evict_cached_past(e, block_ids, (4, 0))
    recorded = _recorded_over(e, e.step)
    assert recorded == (0, 0, 1, _hit_kept_where_a_load_passes(e))
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
