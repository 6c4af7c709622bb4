"""The harness itself: it runs vLLM's real scheduler and catches bad data."""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.mamba import (
    PROMPT,
    mamba_engine,
    prompt_on_the_cpu_only,
    skip_where_a_load_is_refused,
)
from harness.runner import ZEROED, holds_past

PROMPT_A = list(range(100, 700))
PROMPT_B = list(range(5000, 5600))


def run_until_stored(e: Engine) -> None:
    """Run, then take empty steps until one starts no store. Engine.run()
    stops once every transfer completed. In lazy mode a step taken only
    for a store in flight starts no other (0024 and R11: an idle engine
    kept stepping for its stores must stop), so the blocks the release's
    scans would store in those steps are stored here by the empty steps
    after them, as a busy engine's next steps would. Bounded: a CPU tier
    smaller than the GPU prefix cache would store for ever."""
    e.run()
    if e.offload is None or not e.offload._lazy_mode:
        return
    for _ in range(100):
        e.step()
        if not e.offload.has_pending_stores():
            return
        e.run()
    raise AssertionError("the lazy scans still store after 100 empty steps")


def run_three(cfg: HarnessConfig, corrupt_cpu: bool = False) -> Engine:
    """A, then B (evicting A from the GPU), then A extended (hits A on CPU)."""
    e = Engine(cfg)
    e.add_request(PROMPT_A, max_tokens=4)
    run_until_stored(e)
    e.add_request(PROMPT_B, max_tokens=4)
    run_until_stored(e)
    if corrupt_cpu:
        for block_id in e.kv.cpu:
            e.kv.cpu[block_id] = ("garbage", block_id)
    e.add_request(PROMPT_A + [7, 8, 9], max_tokens=4)
    e.run()
    return e


# (hybrid, full attention's and sliding window's block size multiples)
LAYOUTS = {
    "full": (False, 1, 1),
    "hybrid": (True, 1, 1),
    "hybrid-full-blocks-larger": (True, 2, 1),
    "hybrid-window-blocks-larger": (True, 1, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_requests_finish_with_loads_and_consistent_pools(layout, lazy):
    hybrid, full_multiple, swa_multiple = LAYOUTS[layout]
    cfg = HarnessConfig(
        hybrid=hybrid,
        full_block_multiple=full_multiple,
        swa_block_multiple=swa_multiple,
        lazy=lazy,
        num_gpu_blocks=64,
        num_cpu_blocks=256,
        transfer_delay=lambda is_store: 3,
    )
    e = run_three(cfg)
    assert len(e.stats.finished) == 3
    loaded = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loaded, "the third request should load its prefix from the CPU"
    assert e.runner.violations == []
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )


def test_content_check_catches_a_corrupted_cpu_block():
    cfg = HarnessConfig(num_gpu_blocks=64, num_cpu_blocks=256)
    e = run_three(cfg, corrupt_cpu=True)
    assert e.runner.violations, "loading garbage must be caught by value"
    assert "garbage" in str(e.runner.violations[0])


def test_content_check_takes_more_past_a_hit_only_in_an_attention_block():
    want = ("part", 0, 7, (1, 2, 3))
    more = ("part", 0, 7, (1, 2, 3, 9, 9))
    assert holds_past(more, want, "full") and holds_past(more, want, "swa")
    assert not holds_past(more, want, "mamba"), "a state after more tokens"
    for got in (
        ("part", 0, 7, (1, 2, 4, 9)),
        ("part", 0, 8, (1, 2, 3, 9)),
        ("part", 0, 7, (1, 2)),
        ("full", 0, 7),
        ZEROED,
        None,
    ):
        assert not holds_past(got, want, "full"), got
    # The whole block, as the reader's own tokens fill it (another request
    # computed it to its end; the hit ends inside it).
    full = ("full", 0, 11)
    assert holds_past(full, want, "full", own_full=full)
    assert not holds_past(full, want, "full", own_full=("full", 0, 12))
    assert not holds_past(full, want, "mamba", own_full=full)


def test_content_check_reads_what_the_whole_batch_wrote():
    """One request's last block given to another too (as a block shared
    without its copy on write): in a step where both write it, each reads
    the other's tokens there, whatever the batch order, as a GPU writes the
    whole batch's KV before attention reads it. The first in the batch was
    missed while reads saw only earlier requests' writes."""
    e = Engine(HarnessConfig(offload=False, num_gpu_blocks=64))
    first = e.add_request(list(range(100, 120)), max_tokens=4)
    second = e.add_request(list(range(500, 520)), max_tokens=4)
    e.step()
    tables = e.runner.tables
    tables[second][0][-1] = tables[first][0][-1]
    e.step()
    assert {v.req_id for v in e.runner.violations} == {first, second}


def test_transfers_complete_when_told():
    cfg = HarnessConfig(
        num_gpu_blocks=64, num_cpu_blocks=64, transfer_delay=lambda is_store: 5
    )
    e = Engine(cfg)
    # Decodes after the prefill: eager mode stores confirmed blocks a step
    # later, so the request must outlive its prefill step.
    e.add_request(list(range(64)), max_tokens=4)
    e.step()
    e.step()
    assert e.offload._store_event_to_blocks, "a store is in flight"
    while e.offload._store_event_to_blocks:
        e.step()
    assert e.stats.steps >= 6
    assert len(e.offload.cpu_block_pool.cached_block_hash_to_block) == 4


def test_without_offload_the_scheduler_runs_alone():
    e = Engine(HarnessConfig(offload=False, num_gpu_blocks=64))
    e.add_request(PROMPT_A, max_tokens=3)
    e.add_request(PROMPT_A[:320], max_tokens=3)
    e.run()
    assert len(e.stats.finished) == 2 and e.runner.violations == []
    assert_pool_ok(e.block_pool, all_done=True)


def test_groups_of_different_block_sizes_share_one_page_size():
    """A group whose blocks hold more tokens has smaller heads, as vLLM's
    page-size unification makes it: the groups share one tensor and one
    pool. The scheduler hashes at the smallest block size (vLLM's
    cache_config.block_size), and the runner checks each group's blocks
    at that group's size."""
    cfg = HarnessConfig(block_size=16, hybrid=True, full_block_multiple=2)
    e = Engine(cfg)
    specs = [g.kv_cache_spec for g in e.kv_cache_config.kv_cache_groups]
    assert [s.block_size for s in specs] == [32, 16]
    assert specs[0].page_size_bytes == specs[1].page_size_bytes
    assert e.hash_block_size == 16
    a = e.add_request(list(range(100, 164)), max_tokens=2)
    e.step()  # the whole prompt
    assert len(e.requests[a].block_hashes) == 4
    assert [len(ids) for ids in e.runner.tables[a]] == [2, 4]
    e.run()
    assert e.runner.violations == []


@pytest.mark.parametrize("mode", ["align", "all"])
def test_new_blocks_are_zeroed_on_the_compute_stream(mode):
    """With a Mamba group the scheduler names the new blocks for the worker
    to zero; the fake runner zeroes them on the compute stream ahead of the
    forward, which then writes them, so nothing reads a zeroed block."""
    e = mamba_engine(mode)
    e.add_request(PROMPT, max_tokens=3)
    so = e.step()
    assert so.new_block_ids_to_zero, "a Mamba hybrid zeroes new blocks"
    e.run()
    assert e.runner.violations == [] and e.cuda.races == []


@pytest.mark.parametrize("mode", ["align", "all"])
def test_zeroing_a_loads_destination_is_a_race(mode):
    """The worker zeroes on the compute stream before the step's loads are
    launched on the load stream, which waits for nothing: a block the
    scheduler names both for zeroing and as a CPU load's destination (up
    to 0.25.1 it names them, vllm#48481) is written twice, unordered. The
    checker reports exactly those blocks."""
    e = mamba_engine(mode)
    prompt_on_the_cpu_only(e)
    e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    zeroed: set[int] = set()
    loaded: set[int] = set()
    with skip_where_a_load_is_refused(mode):
        while e.busy():
            so = e.step()
            if so is None:
                continue
            zeroed |= set(so.new_block_ids_to_zero or ())
            loaded |= set(so.kv_connector_metadata.load_gpu_blocks)
    assert loaded, "the extension loads its prefix from the CPU"
    assert {r.block for r in e.cuda.races} == zeroed & loaded
    assert all("zeroing" in r.first.op.name for r in e.cuda.races)
    assert e.runner.violations == []


def _recovers_hybrid_failures_whole() -> bool:
    """0.30.0 alone: vllm#50388 recomputes a hybrid request whose load failed
    block by block from its first token, and 0.31.0 takes it back (#56855:
    a block-level report is ambiguous under the hybrid allocator) for a
    RuntimeError that names the limit."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    handler = inspect.getsource(Scheduler._update_requests_with_invalid_blocks)
    return "req_block_ids_per_group" in handler


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("valid_blocks", [0, 1], ids=["whole", "in-part"])
def test_a_failed_load_on_a_mamba_hybrid_stops_the_engine(valid_blocks, policy):
    """A known limit, pinned (docs/ledger.md, hybrid-load-failure-crash):
    the scheduler's handling of a KV load's invalid blocks unpacks one KV
    cache group, so a block-level load failure on a layout of two groups or
    more (a Mamba hybrid has at least two) raises ValueError; from 0.31.0 a
    RuntimeError names the limit. 0.30.0 recovers instead: under the "fail"
    policy the request ends with an error, under "recompute" it loads
    again and finishes, and the engine goes on. Patch 0014 (0.19.0-0.25.1)
    leaves out upstream's zeroing of a failed load's unwritten blocks
    because of the limit: when this test fails, a release recovers in a
    new way, and 0014 (where it is carried) needs that zeroing back."""
    from typing import get_args

    from vllm.config.cache import MambaCacheMode

    # 'all' where the release has it; 'align' refuses a connector's load
    # before 0.23.0.
    mode = "all" if "all" in get_args(MambaCacheMode) else "align"
    e = mamba_engine(mode, kv_load_failure_policy=policy)
    prompt_on_the_cpu_only(e)
    r = e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    e.fail_next_load(r, valid_blocks=valid_blocks)
    if not _recovers_hybrid_failures_whole():
        with pytest.raises(
            (ValueError, RuntimeError), match="unpack|multiple KV cache groups"
        ):
            e.run()
        return
    e.run()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    if policy == "fail":
        assert (e.stats.finish_reasons[r], len(loads)) == ("ERROR", 1)
    else:
        assert (e.stats.finish_reasons[r], len(loads)) == ("LENGTH", 2)
    assert e.runner.violations == []


def test_a_load_failed_by_request_on_a_mamba_hybrid_is_recomputed():
    """What upstream asks of connectors on hybrids instead (docs/ledger.md,
    hybrid-load-failure-crash): a load that fails is reported by request
    (KVConnectorOutput.failed_recving, 0.30.0 on), and under the "recompute"
    policy the request goes back to waiting and looks its prefix up again:
    the CPU still holds it, so it loads again and reads nothing the failed
    load left. Skipped before 0.30.0 (no failed_recving)."""
    from typing import get_args

    from vllm.config.cache import MambaCacheMode

    mode = "all" if "all" in get_args(MambaCacheMode) else "align"
    e = mamba_engine(mode, kv_load_failure_policy="recompute")
    prompt_on_the_cpu_only(e)
    r = e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    try:
        e.fail_next_load(r, by_request=True)
    except NotImplementedError as no_field:
        pytest.skip(str(no_field))
    e.run()
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert len(loads) == 2, "the failed load, then the retry"
    assert e.stats.finish_reasons[r] == "LENGTH"
    assert e.runner.violations == []
