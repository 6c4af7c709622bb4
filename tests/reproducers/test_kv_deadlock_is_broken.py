"""Reproducer for patch 0010: waiting requests that hold KV blocks do not
deadlock the engine.

A streaming session keeps the KV blocks of what it computed while it waits
for its next input, and keeps them while that input waits to be scheduled.
Two sessions each given a longer input can each need more blocks than are
free, the rest being held by the other: the waiting scan stops at the
first, nothing runs, no step frees a block, and the engine schedules
nothing, forever, with both waiting and no error. Every bare release from
0.19.0 to 0.33.0 stalls so (the differential oracle's "mixed" traces
found it: 30 of 400 generated traces on bare 0.33.0).
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.v1.request import RequestStatus

from harness.engine import Engine, HarnessConfig
from harness.holders import (
    BS,
    computed,
    holders_and_a_failed_load,
    preempted_over,
    sessions_holding_most_blocks,
)
from harness.invariants import assert_manager_ok
from harness.offload_checks import loads_in_flight_engine
from harness.trace_replay import assert_runs_to_the_end, replay


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_sessions_that_hold_blocks_do_not_deadlock(policy):
    e, a, b = sessions_holding_most_blocks(policy)
    # Each session's next input: 60 tokens more, 4 blocks more than free.
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    for _ in range(10):
        e.step()
    # B (last in either order) gave its blocks back; A ran its input and
    # idles again, holding 12 blocks. B fits only once A has ended.
    assert computed(e, a) > 120, "the scheduler is stuck: neither input ran"
    e.add_request([0], 1, a)  # A's end
    for _ in range(10):
        e.step()
    assert computed(e, b) > 120, "B's input did not run after A ended"
    e.add_request([0], 1, b)
    e.run(max_steps=100)
    assert {a, b} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_an_idle_session_keeps_its_blocks():
    # A waits for blocks that idle session B holds. B's client may still
    # send its next input, so B's KV stays until B ends; then A runs.
    e, a, b = sessions_holding_most_blocks("fcfs")
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True)
    held = e.scheduler.kv_cache_manager.get_block_ids(b)
    for _ in range(5):
        e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(b) == held
    assert computed(e, a) == 120
    e.add_request([0], 1, b)  # B's end
    for _ in range(5):
        e.step()
    assert computed(e, a) > 120
    e.add_request([0], 1, a)
    e.run(max_steps=100)
    assert {a, b} <= e.stats.finished
    assert e.runner.violations == []


def test_the_freed_request_is_reported_as_preempted():
    # The worker drops its state and the connector flushes the transfers
    # that may still read its blocks, as for any preempted request.
    e, a, b = sessions_holding_most_blocks("priority")
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    preempted = preempted_over(e, 3)
    assert preempted == {b}


def test_the_freed_request_is_left_as_a_preempted_one_is():
    # With stats on it gets a PREEMPTED event; its drafted tokens go, as
    # they went with the blocks they were to be checked against.
    e, a, b = sessions_holding_most_blocks("priority", log_stats=True)
    freed = e.scheduler.requests[b]
    freed.spec_token_ids = [5, 6]
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    for _ in range(3):
        if b in (e.step().preempted_req_ids or ()):
            break
    else:
        pytest.fail("B was not freed")
    assert "PREEMPTED" in [event.type.name for event in freed.events or ()]
    assert list(freed.spec_token_ids) == []


def test_a_freed_session_finds_only_its_own_prefix():
    # S's prompt (31 tokens) and its sampled token t fill block 1; S drops
    # t for its new input, but its hash of block 1 may still include t. R,
    # which carries t at that place, caches block 1. Freed, S looks its
    # prefix up again: it must not take R's block 1 for its own.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=20,
            offload=False,
            policy="priority",
            max_num_batched_tokens=256,
        )
    )
    prompt = [100 + t for t in range(31)]
    s = e.add_request(prompt, 1, "S", resumable=True, priority=1)
    a = e.add_request([1000 + t for t in range(100)], 1, "A", resumable=True)
    for _ in range(3):
        e.step()
    sampled = e.scheduler.requests[s].all_token_ids[31]
    e.add_request([2000 + t for t in range(188)], 2, a, resumable=True)
    e.add_request([5000 + t for t in range(16)], 2, s, resumable=True, priority=1)
    for _ in range(4):
        e.step()
    assert e.scheduler.requests[s].num_computed_tokens == 0, "S should be freed"
    e.abort(a)
    e.add_request(prompt + [sampled] + [9000 + t for t in range(16)], 1, "R")
    for _ in range(6):
        e.step()
    assert e.runner.violations == []


class WrappedLikeMultiConnector:
    """The connector as this release's MultiConnector shows it: it wraps the
    real one (in `_connectors`) and forwards only the has_pending_* hooks
    MultiConnector itself defines (on 0.19.0-0.29.0, none that
    SimpleCPUOffload answers)."""

    def __init__(self, inner):
        self._connectors = [inner]
        self._inner = inner

    def __getattr__(self, name):
        if name.startswith("has_pending_") and not hasattr(MultiConnector, name):
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "in-multi"])
def test_nothing_is_freed_while_a_store_can_give_blocks_back(wrapped):
    # Lazy offload: R's blocks are stored on eviction and held until the
    # store completes (3 steps). A session waits for blocks meanwhile: the
    # scheduler waits for the store rather than freeing the other's KV,
    # also when the offload connector is wrapped in a MultiConnector.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=20,
            num_cpu_blocks=64,
            lazy=True,
            max_num_batched_tokens=256,
            transfer_delay=lambda is_store: 3 if is_store else 0,
        )
    )
    if wrapped:
        e.scheduler.connector = WrappedLikeMultiConnector(e.scheduler.connector)
    a = e.add_request([100 + t for t in range(128)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(64)], 1, "B", resumable=True)
    for _ in range(9):
        e.step()
    e.add_request([900 + t for t in range(48)], 1, "R")
    e.step()
    e.step()
    e.add_request([500 + t for t in range(80)], 2, a, resumable=True)
    e.add_request([700 + t for t in range(16)], 2, b, resumable=True)
    for _ in range(6):
        assert not e.step().preempted_req_ids, "freed while a store was pending"
        if e.scheduler.requests[b].num_computed_tokens > 64:
            break
    else:
        pytest.fail("B's input never ran")


def test_a_session_once_preempted_keeps_its_blocks_with_a_connector():
    # Freed, B could take an async CPU load; promoted after it, a request
    # ever preempted goes to the worker as resumed, and the V1 runner would
    # keep B's previous prompt. So B keeps its blocks, and the two wait as
    # on the release.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=20,
            num_cpu_blocks=64,
            policy="priority",
            max_num_batched_tokens=256,
        )
    )
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(120)], 1, "B", resumable=True, priority=1)
    for _ in range(3):
        e.step()
    e.scheduler.requests[b].num_preemptions = 1  # preempted in an earlier turn
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    preempted = preempted_over(e, 10)
    assert b not in preempted


def test_the_freed_request_is_the_one_the_scheduler_would_take_last():
    # Sessions X (priority 0), Y (2, arrived second) and Z (1, third) hold
    # 8 blocks each, with a CPU offload connector; each is given 100 tokens
    # more, 7 blocks, and 5 are free. The scan stops at X. Of the holders
    # behind it, Y comes last in the priority order, though Z is newer; W,
    # newest and last of all, holds no blocks and is no candidate.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=30,
            num_cpu_blocks=64,
            policy="priority",
            max_num_batched_tokens=256,
        )
    )
    priority = {"X": 0, "Y": 2, "Z": 1}
    for i, r in enumerate(priority):
        e.add_request(
            [100 + 200 * i + t for t in range(120)],
            1,
            r,
            resumable=True,
            priority=priority[r],
        )
    for _ in range(4):
        e.step()
    assert e.block_pool.get_num_free_blocks() == 5
    e.add_request([900 + t for t in range(40)], 1, "W", priority=3)
    for i, r in enumerate(priority):
        e.add_request(
            [1000 + 200 * i + t for t in range(100)],
            2,
            r,
            resumable=True,
            priority=priority[r],
        )
    assert set(e.step().preempted_req_ids or ()) == {"Y"}
    assert computed(e, "Y") == 0 and computed(e, "Z") == 120


def test_a_session_keeps_its_blocks_under_mamba_align():
    # The V1 runner keeps a Mamba "align" state index for each request it
    # has run, cleared only by a step that schedules tokens or by a resume.
    # Freed by a step that schedules nothing, a session would come back to
    # it as a new request with the index of its old blocks: a copy from a
    # block never written, or an index past its new block table. So under
    # Mamba align, sessions keep their blocks and wait, as on the release.
    e, a, b = sessions_holding_most_blocks("priority")
    # What a model with Mamba layers in "align" cache mode sets.
    e.scheduler.need_mamba_block_aligned_split = True
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True, priority=0)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True, priority=1)
    preempted = preempted_over(e, 10)
    assert preempted == set()
    assert computed(e, a) == computed(e, b) == 120


@pytest.mark.parametrize("preempted_before", [False, True])
def test_a_failed_load_gives_back_its_blocks_behind_a_holder(preempted_before):
    # F's load fails whole (its blocks hold nothing it can use); session H,
    # ahead of F in the order, idles on 40 blocks and is then given input
    # that needs 4 more than the 3 free. F's 20 blocks would cover them:
    # F must give them back, and H must run without losing its own KV.
    h = "H"
    e = holders_and_a_failed_load((h, 3000, 40, 0), preempted_before=preempted_before)
    e.add_request([9000 + t for t in range(5 * BS)], 1, h, resumable=True, priority=1)
    preempted = preempted_over(e, 30, lambda: computed(e, h) > 40 * BS)
    assert computed(e, h) > 40 * BS, "the scheduler is stuck behind a failed load"
    assert h not in preempted


def test_a_cleared_failed_load_is_the_only_block_given_back_that_step():
    """F's load fails whole while sessions H and G, given inputs that do not
    fit the 4 free blocks, hold the rest with it. Getting F out of the way
    gives back its 20 blocks, enough for both: nothing else may be freed in
    that step (one intervention per step, then the next scan decides), or G
    recomputes what it had computed for nothing."""
    h, g = "H", "G"
    e = holders_and_a_failed_load((h, 3000, 36, 0), (g, 5000, 3, 3))
    e.add_request([9000 + t for t in range(5 * BS)], 1, h, resumable=True, priority=1)
    e.add_request([9500 + t for t in range(12 * BS)], 1, g, resumable=True, priority=3)
    preempted = preempted_over(
        e, 30, lambda: computed(e, h) > 36 * BS and computed(e, g) > 3 * BS
    )
    assert computed(e, h) > 36 * BS and computed(e, g) > 3 * BS, "stuck"
    assert preempted == set()


def test_no_session_is_freed_for_blocks_a_step_in_flight_gives_back():
    """Under async scheduling with a connector, a request that stops with
    its next step in flight gives its blocks back only once that step is
    processed. When it was the only one running and two sessions wait for
    blocks, nothing runs for that one step, but blocks are coming back:
    the deadlock break must wait for them, not free a session (which
    would then recompute everything it had computed)."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=25,
            num_cpu_blocks=128,
            max_num_batched_tokens=256,
            async_scheduling=True,
        )
    )
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(120)], 1, "B", resumable=True)
    while len(e.stats.finished) < 2 and e.scheduler.running or e.in_flight:
        e.step()
    # C runs and holds 5 blocks; 3 are free.
    c = e.add_request([900 + t for t in range(70)], 40, "C", stop_at=73)
    for _ in range(3):
        e.step()
    assert e.scheduler.running, "C runs"
    # Each session's next input needs 4 blocks more than it holds.
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True)
    preempted = preempted_over(e, 12)
    assert c in e.stats.finished
    assert computed(e, a) > 120, "A's input ran once C's blocks came back"
    assert preempted == set(), f"freed for blocks that were coming back: {preempted}"


def test_nothing_is_freed_while_a_load_in_flight_can_give_blocks_back():
    # Sessions A and C idle on 8 blocks each; L loads a 10-block prefix
    # from the CPU, slowly (5 steps), holding those blocks. A is then given
    # an input 14 blocks longer, with 13 free; C a short one, queued behind
    # A. Nothing runs, but L will land, run and give its blocks back, and A
    # then fits: while L loads the scheduler must wait for it, not free C's
    # KV (C would compute its whole history again).
    prefix = [7000 + t for t in range(10 * BS)]
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=40,
            num_cpu_blocks=256,
            transfer_delay=lambda is_store: 0 if is_store else 5,
        )
    )
    e.add_request(prefix, max_tokens=1)
    e.run()
    # Only the CPU holds the prefix now: L below loads it.
    assert e.block_pool.reset_prefix_cache()
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    c = e.add_request([300 + t for t in range(120)], 1, "C", resumable=True)
    for _ in range(4):
        e.step()
    load = e.add_request(prefix + [1] * (2 * BS), max_tokens=1)
    e.step()
    assert e.offload._reqs_to_load, "L should be loading its prefix"
    e.add_request([500 + t for t in range(14 * BS)], 1, a, resumable=True)
    e.add_request([700 + t for t in range(BS)], 1, c, resumable=True)
    loading = e.scheduler.requests[load]
    for _ in range(20):
        in_flight = (
            loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and load not in e.scheduler.finished_recving_kv_req_ids
        )
        freed = e.step().preempted_req_ids
        assert not (in_flight and freed), f"{freed} freed while L was loading"
        if computed(e, a) > 120 and computed(e, c) > 120:
            break
    else:
        pytest.fail("an input never ran")
    assert load in e.stats.finished, "L should have landed and run"
    for session in (a, c):
        e.add_request([0], 1, session)  # the session's end
    e.run(max_steps=50)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_preempted_session_reloaded_from_the_cpu_does_not_deadlock():
    # S1, a session mid-prompt, is preempted by R and later reloads its
    # prefix from the CPU (a slow load), holding the 10 blocks it loads
    # into; landed, it waits PREEMPTED. Meanwhile session C's input takes
    # every free block and A is given an input: when S1 lands, neither A
    # nor S1 can get a block and nothing runs. One of them must give its
    # blocks back (up to 0.30.0 S1, the newest holder, which saw no new
    # input and so resumes with the prompt the worker knows; from 0.31.0,
    # where S1's finished load is not promoted behind A, A itself). Kept,
    # A and S1 wait for each other forever.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=56,
            num_cpu_blocks=256,
            # Admission checks each prefill chunk only, so that S1 and R
            # prefill side by side until the pool runs out.
            reserve_full_isl=False,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=2 * BS,
            transfer_delay=lambda is_store: 0 if is_store else 12,
        )
    )
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(200)], 1, "B", resumable=True)
    c = e.add_request([600 + t for t in range(120)], 1, "C", resumable=True)
    for _ in range(12):
        e.step()
    e.add_request([5000 + t for t in range(320)], 1, "R")
    s1 = e.add_request([6000 + t for t in range(320)], 1, "S1", resumable=True)
    session = e.scheduler.requests[s1]
    for _ in range(30):
        e.step()
        if session.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    else:
        pytest.fail("S1 should be preempted and then reload its prefix")
    assert session.num_preemptions == 1
    # C's input fills every free block (its 8 held and the free ones).
    free = e.block_pool.get_num_free_blocks()
    e.add_request([900 + t for t in range(free * BS + 8)], 1, c, resumable=True)
    for _ in range(30):
        e.step()
        if e.scheduler.requests[c].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
    assert session.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "S1 landed early"
    e.add_request([1900 + t for t in range(40)], 1, a, resumable=True)
    for _ in range(20):
        if e.step().num_scheduled_tokens:
            break
    else:
        pytest.fail("the scheduler is stuck: A and S1 wait for each other")
    for sid in (b, c):
        e.add_request([0], 1, sid)  # the idle sessions end
    for _ in range(60):
        e.step()
        if computed(e, a) == 160 and computed(e, s1) == 320:
            break
    else:
        pytest.fail("A's input or S1's prompt did not run")
    for sid in (a, s1):
        e.add_request([0], 1, sid)
    e.run(max_steps=50)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_the_freed_request_keeps_its_place_ahead_of_newer_requests():
    """Under FCFS the freed request goes back ahead of the requests that
    hold no blocks, as a preempted one does. 0.33.0's first form queued it
    behind every newer request: stripped of its KV, it waited for all of
    them (found in review)."""
    e, a, b = sessions_holding_most_blocks("fcfs")
    # Arrives after B and needs 7 blocks: it waits, holding none.
    c = e.add_request([900 + t for t in range(100)], 1, "C")
    e.add_request([500 + t for t in range(60)], 2, a, resumable=True)
    e.add_request([700 + t for t in range(60)], 2, b, resumable=True)
    for _ in range(3):
        if b in (e.step().preempted_req_ids or ()):
            break
    else:
        pytest.fail("B was not freed")
    # The queues a waiting request holding no blocks can be in, in the
    # order the scan takes them (skipped_waiting up to 0.30.0).
    queues = [getattr(e.scheduler, "skipped_waiting", ()), e.scheduler.waiting]
    queued = [r.request_id for queue in queues for r in queue]
    assert b in queued and c in queued, queued
    assert queued.index(b) < queued.index(c), queued


def test_a_session_given_input_while_it_ran_does_not_stall_a_tight_hybrid_pool():
    # The differential oracle's async-mixed trace 70 (sliding-window
    # hybrid, async scheduling, no connector, 43 usable blocks): a session
    # is given its next input while it runs; its stop applies it and queues
    # it at the back of the waiting queue, holding blocks (15 on bare
    # 0.30.0, where the head needs 29 with 28 free). Nothing runs, and the
    # scan stops at the head each step: bare 0.26.0-0.30.0 stall with 7 of
    # 13 requests completed (from 0.31.0 the release serves requests that
    # hold blocks first). 0010 frees the session, which may wait for more
    # input and so is no holder 0009 goes on to; the head runs, and the
    # session computes its tokens again.
    record = replay(70, "async-mixed", hash_seed=0)
    assert_runs_to_the_end(record)
    assert len(record["completed"]) == 13


def test_a_finished_load_the_holders_pass_did_not_reach_keeps_what_it_loaded():
    """The request the scan stopped at gives its blocks back for a finished
    load behind it that the holders' pass did not reach (no other holder
    to free): the load keeps what it loaded. The pass promotes every
    finished load it takes, so it must stop before this one, at a load that
    failed whole and is over the budget (chunked prefill off, a 128-token
    budget: what a drafter's slots leave). A (priority 1) and B (2) load
    from the CPU, A's load fails whole, session X (0) idles on 8 blocks. A
    client resets the prefix cache, and X's next input needs 3 blocks more
    with 1 free: the scan stops at X, the pass at A (136 tokens, no hit),
    nothing runs and B waits for KV. Kept, X would leave B to be promoted
    short of 6 blocks and freed, computing again what it loaded.
    """
    prefix_a = [7000 + t for t in range(BS)]
    prefix_b = [8000 + t for t in range(2 * BS)]
    e = loads_in_flight_engine(
        load_steps=3,
        num_gpu_blocks=13,
        num_cpu_blocks=64,
        policy="priority",
        enable_chunked_prefill=False,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    # VllmConfig._set_max_num_scheduled_tokens with drafting slots: with
    # chunked prefill off, a longer prompt runs only on a prefix hit.
    e.scheduler.max_num_scheduled_tokens = 8 * BS
    e.add_request(prefix_a, max_tokens=3)
    e.add_request(prefix_b, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()  # only the CPU holds them now
    a = e.add_request(prefix_a + [1] * 120, 1, "A", priority=1)
    b = e.add_request(prefix_b + [2] * (6 * BS), 1, "B", priority=2)
    e.fail_next_load(a)
    e.step()
    x = e.add_request([100 + t for t in range(120)], 1, "X", resumable=True)
    sched = e.scheduler
    for _ in range(6):
        e.step()
        if {a, b} <= sched.finished_recving_kv_req_ids:
            break
    else:
        pytest.fail("A's and B's loads should have finished")
    assert sched.requests[x].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert computed(e, a) == 0, "A's load should have failed whole"
    assert e.block_pool.get_num_free_blocks() == 1
    # The CPU tier's hashes go (the GPU pool, with blocks in use, refuses).
    assert sched.reset_connector_cache()
    e.add_request([500 + t for t in range(50)], 1, x, resumable=True)
    freed = set(e.step().preempted_req_ids or ())
    status = sched.requests[b].status
    assert status == RequestStatus.WAITING_FOR_REMOTE_KVS, "the pass passed A"
    # (From 0.31.0 the series first clears A's failed load, a step later.)
    e.abort(a)  # A never fits the budget without a hit: its client gives up
    for _ in range(20):
        freed |= set(e.step().preempted_req_ids or ())
        if computed(e, x) > 120:
            break
    else:
        pytest.fail("X's input never ran")
    assert b in e.stats.finished
    assert freed == {x}, f"X should give its blocks back, not B: freed {freed}"
    e.add_request([0], 1, x)  # X's end
    e.run(max_steps=50)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)
