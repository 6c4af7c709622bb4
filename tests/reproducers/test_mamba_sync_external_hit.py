"""Reproducer for a synchronous external hit on a Mamba align-mode hybrid
(ledger row mamba-sync-external-hit-count, vllm#46892).

A connector that loads synchronously (load_kv_async False: a P/D
connector that pulls before the forward, DecodeBenchConnector) has the
scheduler allocate a request's external tokens and its first new tokens
in one allocate_slots call. In align mode the Mamba group then takes a
block for the loaded state (allocate_external_computed_blocks) and, when
the new tokens run past that block, the running state's block(s) after
it; the release's count says 1 + the speculative blocks, one short. At
the smallest free count the count accepts, the pool runs dry inside the
allocation and EngineCore dies in schedule(). The fix counts the loaded
state's block where the new tokens leave it.

The scheduler reaches this from 0.23.0, which let a synchronous external
hit past `_mamba_block_aligned_split`; 0.19.0-0.22.1 assert there first
(row mamba-align-external-hit-assert), so the tests skip there.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from harness.mamba import mamba_engine
from harness.sync_load import allocate_with_external_tokens, load_prefix_synchronously

# Four blocks a remote holder serves, synchronously.
REMOTE_PREFIX = list(range(2000, 2064))


def skip_where_the_scheduler_refuses_first(mamba: str = "mamba_align") -> None:
    if "External KV connector is not verified yet" in inspect.getsource(Scheduler):
        pytest.skip("the scheduler asserts on a synchronous external hit first")
    fields = {f.name for f in dataclasses.fields(MambaSpec)}
    if (
        mamba == "mamba_align_checkpoint"
        and "num_prefill_checkpoint_blocks" not in fields
    ):
        pytest.skip("this release has no prefill checkpoint blocks (from 0.29.0)")


def smallest_served(mamba: str, num_external: int, num_new: int, load: str) -> int:
    """Sweeps the free count: every call is refused or served, never cut
    short, and served from some count on. Returns that count, having
    checked it is what the call took where the count is exact (no
    speculative block, which align mode counts in full where the request
    may reuse it)."""
    outcomes = [
        allocate_with_external_tokens(mamba, num_external, num_new, k, load)
        for k in range(16)
    ]
    kinds = [o for o, _ in outcomes]
    assert set(kinds) <= {"refused", "allocated"}, kinds
    first = kinds.index("allocated")
    assert "refused" not in kinds[first:], kinds
    if mamba != "mamba_align_spec":
        assert outcomes[first][1] == first, outcomes
    return first


ALIGN_GROUPS = ["mamba_align", "mamba_align_spec", "mamba_align_checkpoint"]


@pytest.mark.parametrize("mamba", ALIGN_GROUPS)
@pytest.mark.parametrize("num_external", [16, 40, 64])
@pytest.mark.parametrize("num_new", [1, 8, 24, 40])
def test_the_count_of_a_synchronous_external_hit_covers_what_it_takes(
    mamba, num_external, num_new
):
    """At every free count the allocation is refused or served, never cut
    short; and the smallest count served is what it takes (the fix adds
    the loaded state's block, and only where the allocation takes it)."""
    skip_where_the_scheduler_refuses_first(mamba)
    smallest_served(mamba, num_external, num_new, "sync")


@pytest.mark.parametrize("mamba", ["mamba_align", "mamba_align_checkpoint"])
@pytest.mark.parametrize("num_external", [0, 40, 64])
@pytest.mark.parametrize("num_new", [1, 24, 40])
def test_no_external_hit_and_an_async_load_are_counted_as_before(
    mamba, num_external, num_new
):
    """What the fix must not touch: a first prefill without external
    tokens, and the resume of an async load (its external tokens have
    their blocks), are counted exactly, on the releases and the series."""
    skip_where_the_scheduler_refuses_first(mamba)
    load = "async" if num_external else "sync"
    smallest_served(mamba, num_external, num_new, load)


def test_a_synchronous_external_hit_at_the_edge_of_the_pool():
    """The report's case: 64 external tokens and 1 new one. 5 attention
    blocks, and in the Mamba group the loaded state's block and the new
    token's: 7 blocks, where the release counted 6 and ran the pool dry."""
    skip_where_the_scheduler_refuses_first()
    assert allocate_with_external_tokens("mamba_align", 64, 1, 6) == ("refused", 0)
    assert allocate_with_external_tokens("mamba_align", 64, 1, 7) == ("allocated", 7)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_gpu_blocks", range(8, 16))
def test_an_engine_whose_connector_loads_synchronously_serves_the_hit(
    num_gpu_blocks, async_scheduling
):
    """The scheduler's path: a request runs, and one whose 64-token prefix
    a connector loads synchronously arrives with 1 token past it. At 10
    and 11 GPU blocks the release's count admits it one block short and
    EngineCore dies in schedule() (the harness's guard on the unshared
    pool names the wrong count); the series waits for the block and
    serves the hit, the loaded KV read as it should be. (SimpleCPUOffload
    stores the request's blocks meanwhile; their ordering against the
    forward is 0004's, checked by its reproducers, not here.)"""
    skip_where_the_scheduler_refuses_first()
    e = mamba_engine(
        "align", num_gpu_blocks=num_gpu_blocks, async_scheduling=async_scheduling
    )
    loaded = load_prefix_synchronously(e, REMOTE_PREFIX)
    running = e.add_request(list(range(5000, 5024)), max_tokens=20)
    e.step()
    hit = e.add_request(REMOTE_PREFIX + [7], max_tokens=3)
    e.run(max_steps=300)
    assert {running, hit} <= e.stats.finished
    assert loaded == {hit: len(REMOTE_PREFIX)}
    assert e.runner.violations == []
