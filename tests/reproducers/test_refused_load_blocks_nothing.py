"""Reproducer for patch 0008: a load the admission gate refuses must not
stop the waiting scan.

0008 admits an async KV load only if the blocks the in-flight prefills
still need stay free. A refused load waits, holding nothing. Under priority
scheduling the refused load can head the waiting order while the request
that holds the reserved blocks, an admitted load whose transfer finished,
waits behind it to be promoted. If the scan stops at the refused load, that
request is never promoted, never runs and never frees anything: the engine
schedules nothing, forever. The release drains the same requests (it has
no gate): X then C, or C then X.

Found in review (issue 26): X (priority 1, 50 blocks, 20 on the CPU) is
admitted as a load; C (priority 0, 30 blocks, 20 on the CPU) arrives
while it loads.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok
from harness.offload_checks import loads_in_flight_engine

BS = 16
PREFIX_X = [7000 + t for t in range(20 * BS)]
PREFIX_C = [9000 + t for t in range(20 * BS)]


def engine_with_prefixes_on_cpu(policy: str, load_delay: int) -> Engine:
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=256,
            policy=policy,
            transfer_delay=lambda is_store: 0 if is_store else load_delay,
        )
    )
    e.add_request(PREFIX_X, max_tokens=3)
    e.add_request(PREFIX_C, max_tokens=3)
    e.run()
    # Only the CPU holds the prefixes now: X and C below load them.
    assert e.block_pool.reset_prefix_cache()
    return e


@pytest.mark.parametrize("load_delay", [0, 3], ids=["load-at-once", "load-3-late"])
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_refused_load_does_not_strand_the_load_behind_it(policy, load_delay):
    e = engine_with_prefixes_on_cpu(policy, load_delay)
    x = e.add_request(PREFIX_X + [1] * (30 * BS), max_tokens=2, priority=1)
    e.step()
    assert e.offload._reqs_to_load or x in e.scheduler.finished_recving_kv_req_ids, (
        "X should be admitted as an async load"
    )
    c = e.add_request(PREFIX_C + [2] * (10 * BS), max_tokens=2, priority=0)
    e.run(max_steps=300)  # raises where the scheduler is stuck
    assert {x, c} <= e.stats.finished
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_loads_that_failed_whole_do_not_reserve_blocks_for_each_other():
    # Found in review: two loads fail whole (kv_load_failure_policy
    # "recompute") and give their blocks back; a streaming session then
    # idles holding 20 blocks. Had the failed loads stayed in flight, each
    # would reserve its whole prompt against the other (43 free, 30 each
    # reserved, 20 to load): both refused, nothing running, forever. The
    # release, with no reservation, finishes both.
    e = loads_in_flight_engine(load_steps=3)
    e.add_request(PREFIX_X, max_tokens=1)
    e.add_request(PREFIX_C, max_tokens=1)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    f1 = e.add_request(PREFIX_X + [1] * (10 * BS), max_tokens=2)
    f2 = e.add_request(PREFIX_C + [2] * (10 * BS), max_tokens=2)
    e.fail_next_load(f1)
    e.fail_next_load(f2)
    e.step()
    session = [3000 + t for t in range(20 * BS)]
    e.add_request(session, max_tokens=1, req_id="session", resumable=True)
    for _ in range(60):
        e.step()
        if {f1, f2} <= e.stats.finished:
            break
    assert {f1, f2} <= e.stats.finished, (
        "the failed loads wait for each other while the session idles"
    )


def test_a_load_that_failed_in_part_stays_reserved_for():
    # The counterpart of the test above: a load that fails in part keeps
    # its valid blocks and prefills the rest, so it still needs blocks and
    # must keep its place in the in-flight prefills until it is scheduled.
    # F (priority 1, 30 blocks) loads 20 blocks, of which the first 10
    # come back valid; W (priority 0, 30 blocks, admitted while F loads)
    # loads 20 that all fail, one step after F's land. A streaming session
    # idles on 20 blocks meanwhile: 3 of 63 are free when F's load lands,
    # short of the 10 F still needs, so F waits, promoted, holding its 20.
    # W's load then fails, W gives its 20 back and asks to load them
    # again: 23 are free, less F's 10 still to come, 13, too few, so W
    # waits and F runs. Had F left the in-flight prefills, W would be
    # admitted on the 23; F and W would then each hold 20 blocks and need
    # 10 more, with 3 free and nothing running: a deadlock, which the
    # series breaks by making F give its blocks back (a preemption; its
    # valid prefix lost, loaded again), and which a release without a
    # breaker never leaves. The admission checks only the first prefill
    # chunk (reserve_full_isl off), as for a long prompt, so that the
    # in-flight reservation alone keeps W out; a step's budget takes
    # either prompt's rest in one chunk, so F, once scheduled, is done
    # prefilling.
    e = loads_in_flight_engine(
        load_steps=3,
        policy="priority",
        max_num_batched_tokens=32 * BS,
        reserve_full_isl=False,
    )
    e.add_request(PREFIX_X, max_tokens=1)
    e.add_request(PREFIX_C, max_tokens=1)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    valid_blocks = 10
    f = e.add_request(PREFIX_X + [1] * (10 * BS), max_tokens=2, priority=1)
    e.fail_next_load(f, valid_blocks=valid_blocks)
    e.step()
    w = e.add_request(PREFIX_C + [2] * (10 * BS), max_tokens=2, priority=0)
    e.fail_next_load(w)
    session = [3000 + t for t in range(20 * BS)]
    e.add_request(session, max_tokens=1, req_id="session", resumable=True)
    # The tokens F is given to compute, and what it held when its load
    # landed (its computed tokens, cut to the first invalid block).
    f_scheduled = 0
    f_after_load: int | None = None
    for _ in range(60):
        so = e.step()
        if so is not None:
            f_scheduled += so.num_scheduled_tokens.get(f, 0)
        req = e.requests[f]
        if f_after_load is None and req.status == RequestStatus.WAITING:
            f_after_load = req.num_computed_tokens
        if {f, w} <= e.stats.finished:
            break
    assert not e._failing_loads, "both loads should have failed"
    assert f_after_load == valid_blocks * BS, (
        f"F's load should keep its first {valid_blocks} blocks, "
        f"kept {f_after_load} tokens"
    )
    assert {f, w} <= e.stats.finished, "F and W should both finish"
    assert e.stats.preemptions == 0, (
        "F, promoted and waiting for blocks, was made to give its blocks "
        "back: the other load took the blocks it was still owed"
    )
    # F computes what its load did not give it, and its one decode step.
    assert f_scheduled == (30 - valid_blocks) * BS + 1
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager)
