"""Reproducer for patch 0009: a request that holds KV blocks is not kept
waiting behind one that cannot be scheduled.

An async KV load takes GPU blocks for the prefix it loads and waits, in
the skipped-waiting queue, until the transfer finishes; only when the
waiting scan reaches it is it promoted and scheduled. Under priority
scheduling a request that arrives later with a higher priority heads the
scan. If that request cannot get its blocks, the scan stops there, the
finished load behind it is never promoted, and with nothing running no
step frees a block: the engine schedules nothing, forever, with two
requests waiting (issue 26; the same class as vllm-project/vllm#45388,
which upstream closed for good by draining KV holders first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok
from harness.offload_checks import loads_in_flight_engine
from harness.queue_state import (
    fcfs_violations,
    heap_list,
    is_known_upstream,
    membership_violations,
)
from harness.trace_replay import assert_runs_to_the_end, replay

BS = 16
PREFIX = [7000 + t for t in range(20 * BS)]


def idle(e: Engine) -> bool:
    return not e.busy()


def first_scheduled(
    e: Engine, max_steps: int = 100, done: Callable[[Engine], bool] = idle
) -> dict[str, int]:
    """The step in which each request was first scheduled, stepping until
    `done` (by default: until the engine has nothing left to do)."""
    first: dict[str, int] = {}
    for step in range(max_steps):
        if done(e):
            break
        for req_id in e.step().num_scheduled_tokens:
            first.setdefault(req_id, step)
    return first


def engine_with_prefix_on_cpu(
    load_delay: int, num_gpu_blocks: int = 44, **overrides: Any
) -> Engine:
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=256,
            policy="priority",
            transfer_delay=lambda is_store: 0 if is_store else load_delay,
            **overrides,
        )
    )
    e.add_request(PREFIX, max_tokens=1)
    e.run()
    # Only the CPU holds the prefix now: the request below loads it.
    assert e.block_pool.reset_prefix_cache()
    return e


@pytest.mark.parametrize("load_delay", [0, 3], ids=["load-at-once", "load-3-late"])
def test_a_finished_load_is_scheduled_behind_a_head_that_does_not_fit(load_delay):
    # 43 usable blocks. L (priority 1, 23 blocks) loads its 20-block prefix
    # and holds those 20; H (priority 0, 37 blocks, nothing cached) arrives
    # and heads the order, with 23 free: it fits only once L has run.
    e = engine_with_prefix_on_cpu(load_delay)
    low = e.add_request(PREFIX + [1] * (3 * BS), max_tokens=2, priority=1)
    e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(low)[0], (
        "L should be admitted as an async load, holding its prefix's blocks"
    )
    high = e.add_request([5000 + t for t in range(37 * BS)], max_tokens=2)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert {low, high} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_holder_that_does_not_fit_lets_the_next_holder_go():
    # Two finished loads hold their prefixes; the first in priority order
    # needs more than is free, the second fits. The second must run (and
    # then the first), not wait behind the first forever.
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=60, num_cpu_blocks=256, policy="priority"
        )
    )
    other = [9000 + t for t in range(20 * BS)]
    e.add_request(PREFIX, max_tokens=1)
    e.add_request(other, max_tokens=1)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    # 59 usable: B (priority 1) loads 20 and needs 22 in all; A (priority 0)
    # loads 20 and needs 40 in all. Both are admitted (22 + 40 > 59 only
    # counts once they grow), A's remaining 20 do not fit beside B's 22.
    b = e.add_request(other + [2] * (2 * BS), max_tokens=2, priority=1)
    a = e.add_request(PREFIX + [1] * (20 * BS), max_tokens=2, priority=0)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert {a, b} <= e.stats.finished
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_holders_the_scan_does_not_reach_are_kept():
    # Two finished loads behind a head that does not fit, and room for one
    # running request only: the first holder runs, the scan stops at the
    # request limit, and the second must stay queued (not be dropped) and
    # run once the first is done.
    other = [9000 + t for t in range(20 * BS)]
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=256,
            policy="priority",
            max_num_seqs=1,
        )
    )
    e.add_request(PREFIX, max_tokens=1)
    e.add_request(other, max_tokens=1)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    first = e.add_request(PREFIX + [1] * BS, max_tokens=2, priority=1)
    second = e.add_request(other + [2] * BS, max_tokens=2, priority=2)
    e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(second)[0], (
        "both should be admitted as async loads, holding their prefixes"
    )
    # 63 usable, 42 held by the two loads: the head needs 30 and waits.
    head = e.add_request([5000 + t for t in range(30 * BS)], max_tokens=2)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert {first, second, head} <= e.stats.finished
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_holders_the_scan_does_not_reach_keep_their_arrival_order():
    # FCFS: session S heads the skipped queue and is given an input that
    # does not fit beside three finished loads L1, L2, L3 (arrived in that
    # order). The step's token budget covers one holder's rest of prompt,
    # so each pass schedules one holder and puts the others back: they must
    # keep their order, or the load that arrived last overtakes the one
    # before it (FCFS served out of arrival order). The budget, not the
    # request limit, stops the pass: from 0.30.0 an idle session takes a
    # request slot.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=256,
            max_num_batched_tokens=2 * BS,
        )
    )
    prefixes = [[10_000 * (i + 1) + t for t in range(4 * BS)] for i in range(3)]
    for prefix in prefixes:
        e.add_request(prefix, max_tokens=1)
    e.run()
    # Only the CPU holds the prefixes now: the loads below take them.
    assert e.block_pool.reset_prefix_cache()
    session = e.add_request([100 + t for t in range(120)], 1, "S", resumable=True)
    e.run(max_steps=20)
    loads = [
        e.add_request(p + [i + 1] * (2 * BS), max_tokens=1)
        for i, p in enumerate(prefixes)
    ]
    e.step()
    for load in loads:
        assert e.scheduler.kv_cache_manager.get_block_ids(load)[0], (
            f"{load} should be admitted as an async load, holding its prefix"
        )
    # 63 usable: S holds 8 and the loads 12. S's input makes it 58 blocks,
    # which fit only once two of the loads have run and freed theirs.
    e.add_request([500 + t for t in range(808)], 1, session, resumable=True)
    first = first_scheduled(e)
    assert set(loads) <= e.stats.finished
    order = sorted(loads, key=lambda r: first[r])
    assert order == loads, f"loads scheduled in the order {order}, arrived {loads}"
    assert e.requests[session].num_computed_tokens == 928, "S's input did not run"
    e.add_request([0], 1, session)  # S's end
    e.run(max_steps=20)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_session_whose_end_is_queued_goes_on_behind_a_head_that_does_not_fit():
    # The differential oracle's async-mixed trace 115 (CPU offload eager,
    # async scheduling, sliding-window hybrid, 44 blocks, priority): with
    # nothing running, streaming sessions whose client had queued their end
    # held the blocks the head needed, two of them preempted once, so the
    # deadlock break (0010) may not free them. The 0.24.0 release and its
    # series before the sessions' rule both stalled with 7 of 12 requests
    # completed; bare 0.20.2 breaks a block's content on it first.
    record = replay(115, "async-mixed", hash_seed=0)
    assert_runs_to_the_end(record)
    assert len(record["completed"]) == 12


def assert_the_session_waits_behind_the_head(
    e: Engine, session: str, low: str, high: str
) -> None:
    """The finished load L and the head H run, and session S, which may
    wait for more input, is not scheduled before H; then S's end drains
    the engine with every block back."""
    first = first_scheduled(
        e, done=lambda eng: high in eng.stats.finished and not eng.scheduler.running
    )
    assert {low, high} <= e.stats.finished, f"scheduled first at {first}"
    assert first[high] <= first.get(session, first[high]), (
        f"S, which may wait for more input, ran ahead of H: {first}"
    )
    e.add_request([0], 1, session)  # S's end
    e.run(max_steps=50)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_a_session_that_waits_for_more_input_keeps_its_place_behind_the_head():
    # A finished load L and session S, given its next input but not its end,
    # both hold blocks behind a head H (priority 0) that does not fit, with
    # nothing running. L goes on; S keeps the release's order: run early it
    # would idle again on more blocks (the rule's mixed trace 178), so it is
    # not scheduled before H.
    e = engine_with_prefix_on_cpu(load_delay=0)
    session = e.add_request([100 + t for t in range(10 * BS)], 1, "S", resumable=True)
    e.run(max_steps=20)
    assert e.scheduler.kv_cache_manager.get_block_ids(session)[0], (
        "S idles on its blocks"
    )
    low = e.add_request(PREFIX + [1] * (2 * BS), max_tokens=1, priority=1)
    e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(low)[0], (
        "L should be admitted as an async load, holding its prefix's blocks"
    )
    # 43 usable: S holds 11, L 22; H needs 15 and fits once L has run.
    high = e.add_request([5000 + t for t in range(15 * BS)], max_tokens=1)
    e.add_request([300 + t for t in range(BS)], 1, session, resumable=True)
    assert_the_session_waits_behind_the_head(e, session, low, high)


def test_a_session_given_its_next_input_while_it_ran_keeps_its_place_behind_the_head():
    # As above, but the client sends S's next input while S still runs: it
    # is queued (not applied), and S's stop applies it. That queued input is
    # not S's end, so S may wait for more input again and is no holder: it
    # keeps its place behind H. Only a queued end makes a session a holder.
    e = engine_with_prefix_on_cpu(load_delay=0)
    session = e.add_request([100 + t for t in range(10 * BS)], 3, "S", resumable=True)
    e.step()
    low = e.add_request(PREFIX + [1] * (2 * BS), max_tokens=1, priority=1)
    e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(low)[0], (
        "L should be admitted as an async load, holding its prefix's blocks"
    )
    high = e.add_request([5000 + t for t in range(15 * BS)], max_tokens=1)
    running = e.scheduler.running
    assert e.scheduler.requests[session] in running, "S should still run"
    e.add_request([300 + t for t in range(BS)], 1, session, resumable=True)
    for _ in range(10):
        if e.scheduler.requests[session] not in running:
            break
        e.step()
    assert e.scheduler.requests[session] not in running, "S should have stopped"
    # The premise: S waits on its blocks with its next input applied, and
    # neither L nor H has run yet.
    assert e.scheduler.requests[session].status == RequestStatus.WAITING
    assert e.scheduler.kv_cache_manager.get_block_ids(session)[0]
    assert not {low, high} & e.stats.finished, "the scan should stop at H first"
    assert_the_session_waits_behind_the_head(e, session, low, high)


@pytest.mark.parametrize("first_input", [3 * BS, 1], ids=["3-blocks", "1-token"])
def test_a_new_request_behind_the_head_is_no_holder(first_input):
    # Session S (priority 1) runs its first input with its next input and
    # its end queued; its stop applies the next input, and S waits on its
    # blocks with its end queued: a holder. H (priority 0) needs one block
    # more than is free, and N (priority 1), new, holds nothing. With
    # nothing running the scan goes on to S, whose blocks H needs once S
    # ends; N keeps its place behind H. The 1-token case: a session that
    # computed a single token holds a block too.
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=44, num_cpu_blocks=256, policy="priority"
        )
    )
    prompt = [100 + t for t in range(first_input)]
    session = e.add_request(prompt, 1, "S", resumable=True, priority=1)
    e.add_request([300 + t for t in range(BS)], 1, session, resumable=True)
    e.add_request([0], 1, session)  # S's end
    e.step()
    assert e.scheduler.requests[session].num_computed_tokens == first_input
    free = e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    high = e.add_request([5000 + t for t in range((free + 1) * BS)], max_tokens=1)
    new = e.add_request([800 + t for t in range(BS)], max_tokens=1, priority=1)
    first = first_scheduled(e)
    assert {session, high, new} <= e.stats.finished, f"scheduled first at {first}"
    assert first[session] < first[high] <= first[new], (
        f"S (its end queued) should go on before H, and N not before H: {first}"
    )
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_with_a_request_running_a_finished_load_waits_behind_the_head():
    # R (priority 0) decodes; H (priority 1) does not fit beside R and the
    # finished load L (priority 2). R gives its blocks back as it finishes,
    # and the release waits for it: L does not run ahead of H while
    # anything runs (a priority inversion on every saturated step).
    e = engine_with_prefix_on_cpu(load_delay=0)
    running = e.add_request([300 + t for t in range(3 * BS)], max_tokens=30)
    e.step()
    low = e.add_request(PREFIX + [1] * (3 * BS), max_tokens=1, priority=2)
    e.step()
    assert e.scheduler.kv_cache_manager.get_block_ids(low)[0], (
        "L should be admitted as an async load, holding its prefix's blocks"
    )
    # 43 usable: R holds 4 to 5 and L its 20 (3 more to run), 19 are free;
    # H needs 21 and fits once R is done.
    high = e.add_request([5000 + t for t in range(21 * BS)], 1, priority=1)
    first = first_scheduled(e, max_steps=200)
    assert {running, low, high} <= e.stats.finished, f"scheduled first at {first}"
    assert first[high] <= first[low], f"L ran ahead of H while R ran: {first}"
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


@pytest.mark.parametrize(
    ("seed", "hash_seed"), [(32693, 31337), (40, 0)], ids=["32693", "40"]
)
def test_a_head_and_a_preempted_session_both_short_of_blocks_drain(seed, hash_seed):
    # The differential oracle's mixed traces 32693 (seed 31337's campaign,
    # eager, priority, hybrid) and 40 (lazy, FCFS, 19 blocks): with nothing
    # running, the head needs more blocks than are free and so does a
    # session whose end is queued, preempted once, so 0010 may not free it.
    # 0010 frees the head, which needs more than it held: the next scan
    # goes on to the session. The release drains both; the 0.20.2 series
    # stalled on 32693, the 0.25.0-0.27.1 series on 40.
    record = replay(seed, "mixed", hash_seed=hash_seed)
    assert_runs_to_the_end(record)


def skipped_ids(e: Engine) -> list[str]:
    return [r.request_id for r in e.scheduler.skipped_waiting]


def test_a_load_in_flight_keeps_its_place_when_the_scan_stops_in_skipped_waiting():
    """FCFS: a session S idles holding 8 blocks at the head of the skipped
    queue. X's async load fails whole; with L's 40 blocks reserved behind
    it, X cannot load again and waits holding nothing, between S and L,
    whose load is still in flight. S is then given an input that does not
    fit, with nothing running: the scan stops at S inside the skipped
    queue. No holder can go on (X holds nothing, L's copy has not landed),
    so the queue stays S, X, L; a pass that took L for a holder queued it
    again ahead of X, which arrived first. Then everything drains. (The
    bare release refuses nothing for L's reservation: X reloads at once.)"""
    delay = {"load": 2}
    e = loads_in_flight_engine(
        max_num_batched_tokens=1024,
        reserve_full_isl=False,
        transfer_delay=lambda is_store: 0 if is_store else delay["load"],
    )
    # The order is asserted below, where it can be named.
    e.raise_queue_violations = False
    prefix_x = [10_000 + t for t in range(10 * BS)]
    prefix_l = [20_000 + t for t in range(10 * BS)]
    e.add_request(prefix_x, max_tokens=1)
    e.add_request(prefix_l, max_tokens=1)
    e.run()
    assert e.block_pool.reset_prefix_cache()  # only the CPU holds them now
    session = e.add_request([100 + t for t in range(120)], 1, "S", resumable=True)
    e.run(max_steps=20)
    sched = e.scheduler
    assert skipped_ids(e) == [session], "S idles in the skipped queue"

    x = e.add_request(prefix_x + [1] * BS, max_tokens=1)
    e.fail_next_load(x, valid_blocks=0)
    e.step()
    delay["load"] = 30  # L's copy lands long after the scan below
    load = e.add_request(prefix_l + [2] * (40 * BS), max_tokens=1)
    e.step()
    for _ in range(10):
        if x in e.stats.finished or sched.requests[x].status == RequestStatus.WAITING:
            break
        e.step()
    # The premise: X waits holding nothing between S and the load in flight.
    assert x not in e.stats.finished, "L's reservation refuses X's reload"
    assert skipped_ids(e) == [session, x, load]
    assert sched.requests[x].status == RequestStatus.WAITING
    assert not sched.kv_cache_manager.get_block_ids(x)[0], "X holds nothing"
    assert sched.requests[load].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert load not in sched.finished_recving_kv_req_ids, "L is in flight"
    assert not sched.running

    e.add_request([500 + t for t in range(50 * BS)], 1, session, resumable=True)
    e.step()
    assert sched.requests[session].status == RequestStatus.WAITING, "S waits"
    assert skipped_ids(e) == [session, x, load], (
        f"the load in flight ({load}) left its place behind {x}, which "
        f"arrived first: the skipped queue is {skipped_ids(e)}"
    )
    assert fcfs_violations("skipped_waiting", list(sched.skipped_waiting)) == []

    delay["load"] = 0
    for _ in range(100):
        if sched.requests[session].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        e.step()
    assert load in e.stats.finished
    e.add_request([0], 1, session)  # S's end
    e.run(max_steps=100)
    assert {x, load, session} <= e.stats.finished
    assert e.queue_violations == [] and e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


@pytest.mark.parametrize(
    "reserve_full_isl", [True, False], ids=["whole-prompt-check", "allocation"]
)
def test_the_request_set_aside_is_the_one_the_scan_stopped_at(reserve_full_isl):
    """Priority: sessions S and X (priority 0, S older) idle in the
    skipped_waiting heap, S at its head, and the finished load L
    (priority 1) holds its prefix behind them. S's next chunk sets its
    arrival_time in place (the release's own code): S stays at the head
    though X now sorts first. S's chunk does not fit, with nothing running:
    the scan stops at S, _take_kv_holders takes L out of skipped_waiting and
    re-heapifies it, which puts X at the head. S must be the one set aside:
    popping the head instead drops X from every queue and leaves S queued
    twice. Then S's chunk and X's next chunk run and everything drains.
    The scan stops at the whole-prompt check at admission, or without it
    at the allocation's refusal: both set the request aside."""
    # S's whole chunk in one step: without the whole-prompt check, the
    # allocation of its first chunk is what is refused.
    e = engine_with_prefix_on_cpu(
        0, max_num_batched_tokens=1024, reserve_full_isl=reserve_full_isl
    )
    # The session's in-place key change is a known release break the queue
    # check reports too; the breaks this test is about are asserted below.
    e.raise_queue_violations = False
    sched = e.scheduler

    session = e.add_request([100 + t for t in range(3 * BS)], 1, "S", resumable=True)
    e.run(max_steps=20)
    other = e.add_request([300 + t for t in range(2 * BS)], 1, "X", resumable=True)
    e.run(max_steps=20)
    assert sorted(skipped_ids(e)) == sorted([session, other]), "S and X idle"

    load = e.add_request(PREFIX + [1] * (2 * BS), max_tokens=1, priority=1)
    e.step()
    assert sched.kv_cache_manager.get_block_ids(load)[0], (
        "L should be admitted as an async load, holding its prefix's blocks"
    )
    assert load in sched.finished_recving_kv_req_ids, "L's load has landed"

    # S's next chunk: 25 blocks more, which fit only once L has run (on the
    # series 18 are free while L holds 20, and 38 after).
    e.add_request([500 + t for t in range(25 * BS)], 1, session, resumable=True)
    heap = heap_list(sched.skipped_waiting)
    s_req, x_req = sched.requests[session], sched.requests[other]
    # The premise: S heads the heap though X now sorts before it.
    assert heap is not None and heap[0] is s_req
    assert x_req < s_req, "S's next chunk should have moved its key past X's"
    assert not sched.running
    free = e.block_pool.get_num_free_blocks()
    held = len(sched.kv_cache_manager.get_block_ids(session)[0])
    assert s_req.num_tokens > (held + free) * BS, "S's chunk should not fit yet"

    e.step()
    problems = membership_violations(sched)
    assert problems == [], f"a request queued twice or lost: {problems}"
    running = [r.request_id for r in sched.running]
    assert load in e.stats.finished or load in running, (
        f"L, a holder, should go on past S: running {running}"
    )

    # S's chunk runs once L is done; X gets its next chunk too.
    for _ in range(50):
        if s_req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        e.step()
    assert s_req.status == RequestStatus.WAITING_FOR_STREAMING_REQ, "S's chunk ran"
    assert s_req.num_computed_tokens >= 28 * BS - 1
    e.add_request([900 + t for t in range(BS)], 1, other, resumable=True)
    for _ in range(50):
        if x_req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        e.step()
    assert x_req.status == RequestStatus.WAITING_FOR_STREAMING_REQ, (
        f"X's next chunk never ran ({x_req.status.name})"
    )
    e.add_request([0], 1, session)  # S's end
    e.add_request([0], 1, other)  # X's end
    e.run(max_steps=100)
    assert load in e.stats.finished
    assert not sched.requests, f"left unfinished: {list(sched.requests)}"
    unknown = [p for p in e.queue_violations if not is_known_upstream(p)]
    assert unknown == [], f"queue violations: {unknown}"
    assert e.runner.violations == []
    assert_manager_ok(sched.kv_cache_manager, all_done=True)
