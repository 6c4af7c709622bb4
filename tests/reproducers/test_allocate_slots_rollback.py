"""Reproducer for patch 0002: a refused allocate_slots leaves nothing behind.

KVCacheManager.allocate_slots checks its block count, touches the prefix
hits, then allocates group by group from the shared pool. When the pool
refuses blocks its count promised (a pool shared with another engine, or a
count that lies), the unpatched base raises out of allocate_slots and the
groups before the short one keep their new blocks. With the series it
gives back everything the call took, across all groups, and returns None.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.request import Request

from harness.config import unsupported_layout
from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok, manager_snapshot
from harness.kv_manager import (
    computed_blocks,
    hashed_request,
    make_layout_manager,
    schedule,
)
from harness.logs import warnings_of
from harness.offload_checks import lost_or_wrong_cpu_blocks
from harness.peer import PeerEngine

BS = 16

LAYOUTS = [
    ("full",),
    ("full", "swa"),
    ("swa", "full"),
    ("full", "mamba_align"),
    ("mamba_align", "full"),
]


def make_manager(layout: tuple[str, ...], num_blocks: int) -> KVCacheManager:
    return make_layout_manager(layout, num_blocks, BS, max_model_len=4096)


def make_request(req_id: str, tokens: list[int]) -> Request:
    return hashed_request(req_id, tokens, BS)


def refuse_and_compare(
    manager: KVCacheManager, req: Request, num_tokens: int, after_calls: int
) -> None:
    """The pool refuses the call `after_calls` get_new_blocks calls in:
    allocate_slots returns None and, once the peer gives its blocks back,
    the manager is as it was."""
    peer = PeerEngine(manager.block_pool)
    # allocate_slots frees out-of-window blocks even when it returns None.
    manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
    before = manager_snapshot(manager)
    peer.arm(after_calls)
    assert not schedule(manager, req, num_tokens)
    assert peer.strikes, "the peer should have taken blocks"
    peer.release()
    assert manager_snapshot(manager) == before
    assert_manager_ok(manager)


@pytest.mark.parametrize("after_calls", [0, 1], ids=["first-group", "second-group"])
def test_refusal_mid_prefill_gives_back_every_group(after_calls):
    manager = make_manager(("full", "swa"), num_blocks=40)
    req = make_request("r0", list(range(200)))
    assert schedule(manager, req, 64)
    refuse_and_compare(manager, req, 64, after_calls)
    # Nothing was lost: the request goes on and finishes cleanly.
    assert schedule(manager, req, 64)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


@pytest.mark.parametrize("after_calls", [0, 1], ids=["first-group", "second-group"])
def test_refusal_gives_back_touched_prefix_hits(after_calls):
    manager = make_manager(("full", "swa"), num_blocks=40)
    first = make_request("r0", list(range(160)))
    assert schedule(manager, first, 160)
    manager.free(first)  # its blocks stay cached, evictable
    second = make_request("r1", list(range(160)) + list(range(500, 600)))
    hits, num_hit_tokens = computed_blocks(manager, second)
    assert num_hit_tokens > 0
    refuse_and_compare(manager, second, 100, after_calls)
    # The hits are free again, and still hit.
    assert computed_blocks(manager, second)[1] == num_hit_tokens
    assert all(b.ref_cnt == 0 for group in hits.blocks for b in group if not b.is_null)


def test_refusal_keeps_mamba_align_state():
    manager = make_manager(("full", "mamba_align"), num_blocks=40)
    req = make_request("r0", list(range(200)))
    assert schedule(manager, req, 64)
    refuse_and_compare(manager, req, 64, after_calls=1)
    assert schedule(manager, req, 64)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


@pytest.mark.parametrize(
    "layout",
    [("full", "mamba_align_spec"), ("mamba_align_spec", "full")],
    ids=["mamba-refused", "after-mamba"],
)
def test_refusal_puts_back_the_moved_speculative_block(layout):
    # With a speculative block, align mode moves a running request's
    # speculative block to the end of its blocks and leaves a null block in
    # its place; a refused call (Mamba's own, or a later group's) must put
    # it back where it was, or it is lost from the request's blocks.
    manager = make_manager(layout, num_blocks=40)
    req = make_request("r0", list(range(200)))
    assert schedule(manager, req, 64)
    refuse_and_compare(manager, req, 64, after_calls=1)
    assert schedule(manager, req, 64)
    manager.free(req)
    assert_manager_ok(manager, all_done=True)


def test_undoing_another_requests_align_allocation_is_refused():
    # 0.20.2's align-mode free_new_blocks undoes the group's last allocation,
    # which the coordinator makes for the same request just before. Asked
    # for another request, it must refuse rather than move the blocks of
    # the request that made the allocation.
    manager = make_manager(("mamba_align", "full"), num_blocks=40)
    mamba = manager.coordinator.single_type_managers[0]
    if not hasattr(mamba, "_last_allocation"):
        pytest.skip("this release's align undo works from marks, not the last call")
    mamba.allocate_new_blocks("a", 64, 64)
    with pytest.raises(AssertionError):
        mamba.free_new_blocks("b", mamba.req_to_blocks["a"][-1:])
    assert manager_snapshot(manager)["groups"][0]["blocks"]["a"]


def test_a_single_external_token_block_is_not_zeroed():
    # From 0.33 allocate_slots takes the groups whose external-token blocks
    # a KV load writes, and the worker does not zero those: one external
    # token (a P/D prompt's first, say) is such a block too.
    params = inspect.signature(KVCacheManager.allocate_slots).parameters
    if "skip_zeroing_group_ids" not in params:
        pytest.skip("this release zeroes external-token blocks like any other")
    manager = make_manager(("full",), num_blocks=40)
    req = make_request("r0", list(range(40)))
    assert manager.allocate_slots(
        req, 20, num_external_computed_tokens=1, skip_zeroing_group_ids=(0,)
    )
    group = manager.coordinator.single_type_managers[0]
    loaded = group.req_to_blocks["r0"][0]
    assert loaded.block_id not in group.new_block_ids


def partial_hit_manager(layout: tuple[str, ...]) -> KVCacheManager:
    """Blocks of two hash blocks: from 0.33 a prefix hit may then end inside
    a block (with a Mamba align group), and the allocation that follows
    copies that block on write. Skips a release without such hits."""
    manager = make_layout_manager(layout, 40, 2 * BS, 4096, hash_block_size=BS)
    if not getattr(manager.coordinator, "enable_partial_hash_hits", False):
        pytest.skip("this release has no prefix hits that end inside a block")
    return manager


@pytest.mark.parametrize("after_calls", [0, 1, 2])
@pytest.mark.parametrize(
    "layout", [("full", "mamba_align"), ("mamba_align", "full")], ids="+".join
)
def test_refusal_undoes_the_copy_on_write_of_a_partial_hit(layout, after_calls):
    # A's prompt ends one token past a hash block, so the Mamba state is
    # kept at 3 hash blocks: B's hit ends in the middle of its second block
    # in both groups, and B's allocation copies that block on write (a new
    # block, an extra ref on it, a pending copy). A refusal undoes all of it.
    manager = partial_hit_manager(layout)
    a = make_request("a", list(range(3 * BS + 1)))
    assert schedule(manager, a, 3 * BS)
    manager.free(a)
    manager.new_step_starts()
    b = make_request("b", list(range(3 * BS + 1)) + list(range(900, 980)))
    assert computed_blocks(manager, b)[1] == 3 * BS
    refuse_and_compare(manager, b, 64, after_calls)


@pytest.mark.parametrize(
    "layout", [("full", "mamba_align"), ("mamba_align", "full")], ids="+".join
)
def test_refusal_undoes_the_copy_on_write_of_a_running_producer(layout):
    # A keeps its own Mamba state at 3 hash blocks (the end of its prompt but
    # one token); its next step moves that cache entry to a new block and
    # copies the state there. A refusal moves the entry back.
    manager = partial_hit_manager(layout)
    a = make_request("a", list(range(3 * BS + 1)))
    assert schedule(manager, a, 3 * BS)
    manager.new_step_starts()
    groups = manager.coordinator.single_type_managers
    assert any("a" in getattr(g, "_partial_hit_reqs", {}) for g in groups)
    # Its last prompt token fits its blocks: the copy is the only new block.
    refuse_and_compare(manager, a, 1, after_calls=0)


def test_a_running_producers_refused_copy_on_write_in_the_engine():
    """The running producer's copy on write, refused in the scheduler with
    the CPU offload connector: a Mamba align group first, its blocks two
    hash blocks, then full attention at the hash block size. A stops its
    prefill one token short of its prompt, on a hash boundary inside a
    Mamba block, and keeps its state there as a cache entry. Its next step
    moves that entry to a new block, queues the copy of the state into it
    and hands the block to the connector to offload (a boundary state);
    then the full-attention group is refused. The scheduler preempts B and
    retries A. The retry must be the only copy on write left: one cache
    entry, on a block that holds the state, and one boundary handed to the
    connector, not a second naming the block the refused call gave back."""
    H = 16
    cfg = HarnessConfig(
        block_size=H,
        mamba="align",
        mamba_block_multiple=2,
        mamba_first=True,
        num_gpu_blocks=40,
        num_cpu_blocks=40,
        max_num_batched_tokens=256,
    )
    if (reason := unsupported_layout(cfg)) is not None:
        pytest.skip(reason)
    e = Engine(cfg)
    manager = e.scheduler.kv_cache_manager
    if not getattr(manager.coordinator, "enable_partial_hash_hits", False):
        pytest.skip("this release has no prefix hits that end inside a block")
    if not hasattr(manager, "take_boundary_state_offloads"):
        pytest.skip("this release hands no boundary states to a connector")
    # What the scheduler hands the connector each step: the real method's
    # result, kept.
    offered: list[dict[str, list[tuple[int, int, int]]]] = []
    take = manager.take_boundary_state_offloads

    def take_and_keep() -> dict[str, list[tuple[int, int, int]]]:
        offered.append(take())
        return offered[-1]

    manager.take_boundary_state_offloads = take_and_keep
    prompt = list(range(100, 100 + 3 * H + 1))
    a = e.add_request(prompt, max_tokens=3)
    b = e.add_request(list(range(2000, 2000 + 4 * H)), max_tokens=8)
    e.step()
    req = e.requests[a]
    assert req.num_computed_tokens == 3 * H, "A stops on its last hash boundary"

    # A's step: the Mamba group's copy on write succeeds, the full-attention
    # group's block (A's fourth) is refused.
    peer = PeerEngine(e.block_pool)
    peer.arm(after_calls=1)
    so = e.step()
    peer.release()
    assert peer.strikes, "the full-attention group should have been refused"
    assert so.preempted_req_ids == {b} and set(so.num_scheduled_tokens) == {a}
    (copy,) = so.kv_cache_block_copies
    # The cache entry of A's state at the boundary is on the copy, which
    # holds that state (the forward has since moved A's own block on).
    key = make_block_hash_with_group_id(req.block_hashes[2], 0)
    entry = e.block_pool.cached_block_hash_to_block.get_one_block(key)
    assert entry is not None and entry.block_id == copy.dst_block_id
    state = e.runner.oracle.tag(req, 0, 1, H)
    assert e.kv.gpu[copy.dst_block_id] == state
    # One boundary handed to the connector, the retry's.
    assert offered[-1] == {a: [(0, copy.dst_block_id, 3 * H)]}
    e.run()

    # Where the connector counts them: no boundary offered twice (skipped as
    # in flight) or on a block without its entry (dropped as unhashed).
    stats_of = getattr(e.scheduler.connector, "get_boundary_store_stats", None)
    if stats_of is not None:
        stats = stats_of()
        assert stats.skipped_in_flight == stats.dropped_not_hashed == 0, stats
    assert e.runner.violations == [] and e.cuda.races == []
    assert lost_or_wrong_cpu_blocks(e, [a, b]) == []
    assert_manager_ok(manager, all_done=True)


def test_each_refusal_is_logged():
    # A refusal is rare (the count said yes): each one logs a warning that
    # names the request and the pool's error.
    manager = make_manager(("full", "swa"), num_blocks=24)
    peer = PeerEngine(manager.block_pool)
    with warnings_of("vllm.v1.core.kv_cache_manager") as warnings:
        for n in range(3):
            req = make_request(f"r{n}", list(range(100 * n, 100 * n + 16 * 6)))
            peer.arm(1)
            assert not schedule(manager, req, req.num_tokens)
            peer.release()
    assert len(warnings) == 3, warnings
    for n, warning in enumerate(warnings):
        assert f"request r{n} " in warning and "Cannot get" in warning, warning
    assert_manager_ok(manager, all_done=True)


def test_a_lying_count_is_corruption_not_a_refusal():
    # The free queue counts 6 blocks more than it links, as after seed 000's
    # double free. That is no shortage to wait out (the request would wait
    # forever): allocate_slots raises KVCacheCorruptionError, not a
    # ValueError, naming the group that found it and both counts.
    manager = make_manager(("full", "swa"), num_blocks=24)
    queue = manager.block_pool.free_block_queue
    real_free = queue.num_free_blocks
    queue.num_free_blocks += 6
    req = make_request("r0", list(range(16 * (real_free // 2 + 2))))
    with pytest.raises(Exception) as info:
        schedule(manager, req, req.num_tokens)
    err = info.value
    assert type(err).__name__ == "KVCacheCorruptionError", repr(err)
    assert not isinstance(err, ValueError)
    assert str(err).startswith("KV cache group 1: ")
    counts = re.search(r"counts (\d+) free blocks but links only (\d+)", str(err))
    assert counts, str(err)
    assert int(counts[1]) - int(counts[2]) == 6


@pytest.mark.parametrize("layout", [("full", "swa"), ("swa", "full")])
def test_a_lying_count_met_by_external_blocks_names_the_group(layout):
    # The same corruption found while taking the blocks for a connector's
    # external tokens (allocate_new_computed_blocks), before allocate_slots
    # allocates anything else: the error names the group that found it.
    manager = make_manager(layout, num_blocks=24)
    queue = manager.block_pool.free_block_queue
    queue.num_free_blocks += 6
    # 22 full-attention blocks and a window's few: more than the 23 linked,
    # within the 29 counted.
    req = make_request("r0", list(range(16 * 24)))
    with pytest.raises(Exception) as info:
        manager.allocate_slots(
            req, 0, num_external_computed_tokens=16 * 22, delay_cache_blocks=True
        )
    err = info.value
    assert type(err).__name__ == "KVCacheCorruptionError", repr(err)
    assert re.match(r"KV cache group [01]: ", str(err)), str(err)
    assert "links only" in str(err)


@pytest.mark.parametrize(
    "layout",
    [("full",), ("full", "swa"), ("swa", "full")],
    ids=["full", "full+swa", "swa+full"],
)
def test_an_undercount_on_an_unshared_pool_fails_loudly(monkeypatch, layout):
    # The groups' count says one block fewer than the call takes, on a pool
    # no other engine shares (issue 26). The release raises a bare
    # ValueError from the pool. Turning that into a refusal would wait
    # forever with nothing said: the next step counts the same. It must
    # raise KVCacheCorruptionError, naming both counts and the groups, with
    # nothing left taken.
    _undercount_fails_loudly(monkeypatch, layout, reserved=0)


def test_an_undercount_beside_reserved_blocks_fails_loudly(monkeypatch):
    """The same with blocks reserved for the in-flight prefills (an async
    load's admission): the count sees the free blocks less the reserved
    ones, and the pool, refusing, has given back all it took only if it
    holds exactly what the count saw plus the reserve. Skipped where
    allocate_slots takes no reserve."""
    params = inspect.signature(KVCacheManager.allocate_slots).parameters
    if "reserved_blocks" not in params:
        pytest.skip("this release's allocate_slots reserves no blocks")
    _undercount_fails_loudly(monkeypatch, ("full",), reserved=2)


def _undercount_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, layout: tuple[str, ...], reserved: int
) -> None:
    """A count that says `reserved` + 1 blocks fewer than the call takes,
    which takes one block more than the pool holds: KVCacheCorruptionError,
    nothing left taken."""
    manager = make_manager(layout, num_blocks=24)
    first = make_request("r0", list(range(16 * 6)))
    assert schedule(manager, first, first.num_tokens)
    before = manager_snapshot(manager)
    count = manager.coordinator.get_num_blocks_to_allocate
    monkeypatch.setattr(
        manager.coordinator,
        "get_num_blocks_to_allocate",
        lambda *a, **k: count(*a, **k) - 1 - reserved,
    )
    free = manager.block_pool.get_num_free_blocks()
    # Exactly the free blocks, and one more than the count says.
    req = make_request("r1", list(range(1000, 1000 + 16 * 40)))
    # The arguments allocate_slots passes for a request with nothing
    # computed (the count's signature grows across releases).
    params = inspect.signature(count).parameters

    def real_count(n: int) -> int:
        args = {
            "request_id": "r1",
            "num_tokens": n,
            "new_computed_blocks": manager.empty_kv_cache_blocks.blocks,
            "num_encoder_tokens": 0,
            "total_computed_tokens": 0,
            "num_local_computed_tokens": 0,
            "num_tokens_main_model": n,
        }
        return count(**{k: v for k, v in args.items() if k in params})

    num_tokens = next(
        n for n in range(16, req.num_tokens, 16) if real_count(n) == free + 1
    )
    reserve = {"reserved_blocks": reserved} if reserved else {}
    with pytest.raises(Exception) as info:
        manager.allocate_slots(req, num_tokens, **reserve)
    err = info.value
    assert type(err).__name__ == "KVCacheCorruptionError", repr(err)
    said = f"said {free - reserved} blocks fit in {free} free"
    assert said in str(err), str(err)
    assert "Groups: 0: " in str(err), str(err)
    assert manager_snapshot(manager) == before
    assert_manager_ok(manager)


def test_a_peer_that_takes_blocks_is_still_a_refusal():
    # The same refusal where another engine took blocks from the pool
    # between the count and the allocation: a shortage, waited out.
    manager = make_manager(("full", "swa"), num_blocks=24)
    peer = PeerEngine(manager.block_pool)
    peer.arm(after_calls=1)
    req = make_request("r0", list(range(16 * 8)))
    assert manager.allocate_slots(req, req.num_tokens) is None
    assert peer.strikes
    peer.release()
    assert manager.allocate_slots(req, req.num_tokens) is not None


def assert_manager_ok_but_count(manager: KVCacheManager, extra: int) -> None:
    """Nothing was taken: only the planted miscount is left."""
    manager.block_pool.free_block_queue.num_free_blocks -= extra
    assert_manager_ok(manager, all_done=True)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), data=st.data())
def test_random_refusals_leave_the_manager_unchanged(layout, data):
    manager = make_manager(layout, num_blocks=data.draw(st.integers(16, 48)))
    peer = PeerEngine(manager.block_pool)
    prefixes = [list(range(1000 * k, 1000 * k + 160)) for k in (1, 2)]
    live: list[Request] = []
    for n in range(data.draw(st.integers(4, 24))):
        op = data.draw(st.sampled_from(["add", "step", "step", "free"]))
        if op == "add" or not live:
            tokens = prefixes[data.draw(st.integers(0, 1))][
                : data.draw(st.integers(1, 160))
            ]
            live.append(make_request(f"r{n}", tokens + [7, n, 9]))
            continue
        req = data.draw(st.sampled_from(live))
        if op == "free":
            manager.free(req)
            live.remove(req)
            continue
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(11)  # a decode step
        num_tokens = min(
            data.draw(st.integers(1, 64)), req.num_tokens - req.num_computed_tokens
        )
        strike = data.draw(st.none() | st.integers(0, 2))
        manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        before = manager_snapshot(manager)
        if strike is not None:
            peer.arm(strike)
        ok = schedule(manager, req, num_tokens)
        peer.disarm()
        if peer.held:
            assert not ok, "a struck call cannot succeed"
            peer.release()
        if not ok:
            assert manager_snapshot(manager) == before
        assert_manager_ok(manager)
    for req in live:
        manager.free(req)
    assert_manager_ok(manager, all_done=True)


# Every argument of allocate_slots that makes it take blocks, alone: a
# fresh request (nothing held, no prefix hits) in each layout, refused at
# each get_new_blocks call it makes. The manager, new_block_ids (the ids
# the worker zeroes) included, must be exactly as before.
ARGUMENTS = {
    "tokens": dict(num_new_tokens=40),
    "external": dict(
        num_new_tokens=0, num_external_computed_tokens=64, delay_cache_blocks=True
    ),
    "external+tokens": dict(
        num_new_tokens=24, num_external_computed_tokens=64, delay_cache_blocks=True
    ),
    "lookahead": dict(num_new_tokens=40, num_lookahead_tokens=24),
    "encoder": dict(num_new_tokens=40, num_encoder_tokens=48),
}
ARGUMENT_LAYOUTS = [*LAYOUTS, ("full", "cross"), ("cross", "swa")]


def allocate_fresh(manager: KVCacheManager, req: Request, args: dict) -> bool:
    return manager.allocate_slots(req, **args) is not None


# Encoder tokens go with a cross-attention group, and only they do.
ARGUMENT_CASES = [
    pytest.param(layout, args, id=f"{'+'.join(layout)}-{name}")
    for layout in ARGUMENT_LAYOUTS
    for name, args in ARGUMENTS.items()
    if ("cross" in layout) == ("num_encoder_tokens" in args)
]


@pytest.mark.parametrize(("layout", "args"), ARGUMENT_CASES)
def test_refusal_of_every_argument_leaves_nothing_behind(layout, args):
    # How many get_new_blocks calls the allocation makes when it succeeds.
    probe = make_manager(layout, num_blocks=64)
    counter = PeerEngine(probe.block_pool)
    assert allocate_fresh(probe, make_request("r0", list(range(96))), args)
    num_calls = counter.calls
    assert num_calls >= 1
    for after_calls in range(num_calls):
        manager = make_manager(layout, num_blocks=64)
        # Earlier requests' ids recorded this step must survive the refusal.
        assert schedule(manager, make_request("r1", list(range(500, 548))), 48)
        peer = PeerEngine(manager.block_pool)
        before = manager_snapshot(manager)
        req = make_request("r0", list(range(96)))
        peer.arm(after_calls)
        assert not allocate_fresh(manager, req, args), f"call {after_calls}"
        assert peer.strikes
        peer.release()
        assert manager_snapshot(manager) == before, f"refused at call {after_calls}"
        assert_manager_ok(manager)
        # Nothing was lost: the same allocation succeeds next.
        assert allocate_fresh(manager, req, args)


KVCACHED_LAYOUT = Path(__file__).parent.parent / "harness" / "kvcached_layout"


@pytest.fixture
def kvcached_utils(monkeypatch):
    """`kvcached.utils` as laid out in kvcached (a stand-in: kvcached builds
    CUDA code and cannot be installed here, see harness/kvcached_layout)."""
    monkeypatch.syspath_prepend(str(KVCACHED_LAYOUT))
    return importlib.import_module("kvcached.utils")


@pytest.mark.parametrize("after_calls", [0, 1], ids=["first-group", "second-group"])
def test_kvcached_pool_exhausted_is_a_refusal(kvcached_utils, after_calls):
    """kvcached's pool raises KVCachePoolExhausted (a ValueError) when a
    colocated engine took the pages its count promised. It is a shortage:
    allocate_slots gives back what every group took and returns None, so
    kvcached's own wrapper (None for that error, nothing given back) finds
    nothing left to leak."""
    manager = make_manager(("full", "swa"), num_blocks=40)
    peer = PeerEngine(manager.block_pool, raises=kvcached_utils.KVCachePoolExhausted)
    before = manager_snapshot(manager)
    req = make_request("r0", list(range(160)))
    peer.arm(after_calls)
    assert not schedule(manager, req, 160)
    assert peer.strikes
    assert manager_snapshot(manager) == before
    assert schedule(manager, req, 160)


def test_a_plain_value_error_from_the_pool_still_raises(kvcached_utils):
    """Any other ValueError from the pool is a broken contract, not a
    shortage (kvcached insists on that too): it must not become a None that
    the scheduler waits on. A subclass of kvcached's error is a shortage."""
    manager = make_manager(("full", "swa"), num_blocks=40)
    peer = PeerEngine(manager.block_pool, raises=ValueError)
    peer.arm(1)
    with pytest.raises(ValueError, match="the peer took"):
        schedule(manager, make_request("r0", list(range(160))), 160)

    class Narrower(kvcached_utils.KVCachePoolExhausted):
        pass

    manager = make_manager(("full", "swa"), num_blocks=40)
    peer = PeerEngine(manager.block_pool, raises=Narrower)
    peer.arm(1)
    assert not schedule(manager, make_request("r0", list(range(160))), 160)
    assert_manager_ok(manager, all_done=True)
