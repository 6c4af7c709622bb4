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

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok

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
    try:
        e.run(max_steps=300)
    except AssertionError as exc:
        pytest.fail(f"the scheduler is stuck: {exc}")
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
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=256,
            kv_load_failure_policy="recompute",
            transfer_delay=lambda is_store: 0 if is_store else 3,
        )
    )
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
