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
state's block where the new tokens leave it, unless a local hit's block
left free in the cache (counted as taken, but skipped) already covers it.

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


def smallest_served(
    mamba: str,
    num_before: int,
    num_new: int,
    load: str,
    local_hit: int = 0,
    hit_held: bool = False,
    exact: bool = True,
    hash_block_size: int | None = None,
) -> tuple[int, int]:
    """Sweeps the free count (allocate_with_external_tokens): every call is
    refused or served, never cut short, and served from some count on.
    Returns that count and the blocks the call took there, having checked
    they are equal where the count is `exact` (no speculative block, which
    align mode counts in full where the request may reuse it)."""
    outcomes = [
        allocate_with_external_tokens(
            mamba,
            num_before,
            num_new,
            k,
            load,
            local_hit,
            hit_held,
            hash_block_size=hash_block_size,
        )
        for k in range(16)
    ]
    kinds = [o for o, _ in outcomes]
    assert set(kinds) <= {"refused", "allocated"}, kinds
    first = kinds.index("allocated")
    assert "refused" not in kinds[first:], kinds
    if exact and mamba != "mamba_align_spec":
        assert outcomes[first][1] == first, outcomes
    return first, outcomes[first][1]


def checkpoints_counted_loosely(mamba: str) -> bool:
    """0.29.0's count reserves a checkpoint block per request
    (_num_checkpoint_blocks), one more than a synchronous load after a hit
    left free in the cache takes (measured on the bare release and the
    series alike); 0.30.0 on count that exactly."""
    if mamba != "mamba_align_checkpoint":
        return False
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    return "_num_checkpoint_blocks" in inspect.getsource(MambaManager)


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
@pytest.mark.parametrize("hit_held", [False, True], ids=["hit-free", "hit-held"])
@pytest.mark.parametrize("local_hit", [16, 32])
@pytest.mark.parametrize("num_external", [16, 32])
@pytest.mark.parametrize("num_new", [1, 17])
def test_a_synchronous_external_hit_after_a_local_hit(
    mamba, hit_held, local_hit, num_external, num_new
):
    """The same, after a local prefix hit. Left free in the cache by a
    finished request, the hit's Mamba block is counted as taken from the
    free queue, but the external tokens skip it and it stays free, for the
    loaded state: the release's count is right, and the fix's block would
    make the request wait for a block it never takes. Held by a running
    request, the hit block counts nothing, and the loaded state's block is
    the fix's."""
    skip_where_the_scheduler_refuses_first(mamba)
    exact = hit_held or not checkpoints_counted_loosely(mamba)
    smallest_served(mamba, num_external, num_new, "sync", local_hit, hit_held, exact)


@pytest.mark.parametrize(
    "local_hit, num_external, num_new", [(16, 8, 1), (32, 8, 4), (16, 4, 2)]
)
def test_new_tokens_in_the_loaded_block_after_a_hit_left_free(
    local_hit, num_external, num_new
):
    """Where the new tokens end in the loaded state's block, after a hit
    left free in the cache, the release counts one block more than the
    call takes (the hit's Mamba block, as if taken from the free queue;
    it stays free). The fix adds nothing and takes nothing off: the
    release's count, the same on every release from 0.23.0."""
    skip_where_the_scheduler_refuses_first()
    outcomes = [
        allocate_with_external_tokens(
            "mamba_align", num_external, num_new, k, "sync", local_hit
        )
        for k in range(12)
    ]
    first = [o for o, _ in outcomes].index("allocated")
    assert outcomes[first][1] == first - 1, outcomes


@pytest.mark.parametrize("mamba", ["mamba_align", "mamba_align_spec"])
@pytest.mark.parametrize("hit_held", [False, True], ids=["hit-free", "hit-held"])
@pytest.mark.parametrize("local_hit", [8, 24, 40])
@pytest.mark.parametrize("num_external", [16, 32])
@pytest.mark.parametrize("num_new", [1, 17])
def test_a_synchronous_external_hit_after_a_partial_local_hit(
    mamba, hit_held, local_hit, num_external, num_new
):
    """Hashed every 8 tokens, a local hit may end inside a block (a partial
    hit), which the allocation copies on write. Its count is never cut
    short, and the fix leaves it as the release has it: one block over
    what the call takes where the hit's block is left free in the cache,
    and one more where the new tokens end in the loaded state's block (as
    after a whole-block hit). Measured the same on bare 0.29.0, 0.30.0 and
    0.33.0; the fix's block added here too would make the request wait
    for a block it never takes."""
    skip_where_the_scheduler_refuses_first(mamba)
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if "_partial_hit_reqs" not in inspect.getsource(MambaManager):
        pytest.skip("this release takes no prefix hit inside a block")
    first, taken = smallest_served(
        mamba, num_external, num_new, "sync", local_hit, hit_held, False, 8
    )
    assert first - taken == int(not hit_held) + int(num_new == 1), (first, taken)


@pytest.mark.parametrize("mamba", ["mamba_align", "mamba_align_checkpoint"])
@pytest.mark.parametrize(
    "load, num_before, num_new",
    [
        ("sync", 0, 1),  # a first prefill without external tokens
        ("sync", 0, 40),
        ("async", 40, 1),  # the resume of an async load
        ("async", 40, 24),
        ("async", 64, 40),
        ("computed", 10, 7),  # a running request past its first block
        ("computed", 10, 1),
        ("computed", 40, 30),
    ],
)
def test_requests_without_a_synchronous_load_are_counted_as_before(
    mamba, load, num_before, num_new
):
    """What the fix must not touch, counted exactly on the releases and the
    series: a first prefill without external tokens, the resume of an
    async load (its external tokens have their blocks), and a running
    request (one whose prompt is shorter than a block has cached nothing
    yet when its step first crosses one)."""
    skip_where_the_scheduler_refuses_first(mamba)
    # Checkpoint blocks: never cut short, but not exact (0.29.0 reserves
    # one more than a running request's chunk takes, 0.30.0 than an async
    # load's resume; bare and series alike).
    exact = mamba == "mamba_align"
    smallest_served(mamba, num_before, num_new, load, exact=exact)


def test_an_async_load_is_admitted_as_before():
    """The full-sequence check at admission, which the scheduler also makes
    for async loads, keeps the release's count: 7 attention blocks for the
    104-token prompt and 1 Mamba block, though the prompt runs past the
    loaded state's block. (The load's own call then takes 4 + 1.)"""
    skip_where_the_scheduler_refuses_first()
    outcomes = [
        allocate_with_external_tokens("mamba_align", 64, 40, k, "admit")
        for k in range(12)
    ]
    assert [o for o, _ in outcomes].index("allocated") == 8, outcomes
    assert outcomes[8] == ("allocated", 5), outcomes


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
