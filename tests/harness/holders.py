"""Scenes where waiting requests hold KV blocks, for the reproducers of the
deadlock break (tests/reproducers/test_kv_deadlock_is_broken.py): streaming
sessions idling on what they computed between inputs, and a load that
failed whole behind them, with the steps that follow and what they freed.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.engine import Engine, HarnessConfig
from harness.mamba import prompt_on_the_cpu_only
from harness.offload_checks import loads_in_flight_engine

BS = 16


def sessions_holding_most_blocks(
    policy: str, log_stats: bool = False
) -> tuple[Engine, str, str]:
    """19 usable blocks; sessions A and B have each computed a 120-token
    prompt and hold 8 blocks, so 3 are free."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=20,
            offload=False,
            policy=policy,
            max_num_batched_tokens=256,
            log_stats=log_stats,
        )
    )
    a = e.add_request([100 + t for t in range(120)], 1, "A", resumable=True)
    b = e.add_request([300 + t for t in range(120)], 1, "B", resumable=True, priority=1)
    for _ in range(3):
        e.step()
    free = e.block_pool.get_num_free_blocks()
    assert free < 4 and not e.scheduler.running, (
        f"both sessions should idle holding their blocks ({free} free)"
    )
    return e, a, b


def computed(e: Engine, req_id: str) -> int:
    return e.scheduler.requests[req_id].num_computed_tokens


def preempted_over(
    e: Engine, steps: int, done: Callable[[], bool] = lambda: False
) -> set[str]:
    """Step up to `steps` times, stopping once `done()`: the requests the
    scheduler preempted (freed) meanwhile."""
    preempted: set[str] = set()
    for _ in range(steps):
        so = e.step()
        if so is not None:
            preempted |= set(so.preempted_req_ids or ())
        if done():
            break
    return preempted


def holders_and_a_failed_load(
    *holders: tuple[str, int, int, int], preempted_before: bool = False
) -> Engine:
    """Sessions idling on their blocks (each: name, first token, blocks,
    priority), then F (priority 2), whose load of a 20-block prefix from
    the CPU fails whole. With `preempted_before`, the first session was
    preempted in an earlier turn."""
    prefix = [7000 + t for t in range(20 * BS)]
    e = loads_in_flight_engine(load_steps=3, policy="priority")
    prompt_on_the_cpu_only(e, prefix, max_tokens=1)
    for name, first, blocks, priority in holders:
        tokens = [first + t for t in range(blocks * BS)]
        e.add_request(tokens, 1, name, resumable=True, priority=priority)
    for _ in range(8):
        e.step()
    if preempted_before:
        e.scheduler.requests[holders[0][0]].num_preemptions = 1
    f = e.add_request(prefix + [1] * (2 * BS), 2, "F", priority=2)
    e.fail_next_load(f)
    e.step()
    return e
