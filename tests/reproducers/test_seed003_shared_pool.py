"""Reproducer for seed 003: a KV block pool shared with another engine.

kvcached lets several engines share one physical pool. The scheduler counts
free blocks, then allocates them; a peer can take blocks in between. On the
unpatched base the allocation then raises out of Scheduler.schedule() and
kills EngineCore (with the hybrid manager, after the first group already
took its blocks). With the series the allocation gives back what it took
and returns None: the scheduler preempts or waits, and once the peer lets
go every request finishes with nothing leaked.
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_manager_ok, manager_violations
from harness.peer import PeerEngine

HOLD_STEPS = 8


class PeerSchedule:
    """after_step hook: arm the peer at `arm_step`, release it later."""

    def __init__(self, peer: PeerEngine, arm_step: int, after_calls: int = 0):
        self.peer, self.arm_step, self.after_calls = peer, arm_step, after_calls
        self.struck_at: int | None = None
        self.problems: list[tuple[int, list[str]]] = []

    def __call__(self, e: Engine) -> None:
        step = e.stats.steps
        if problems := manager_violations(e.scheduler.kv_cache_manager):
            self.problems.append((step, problems[:5]))
        if step == self.arm_step:
            self.peer.arm(self.after_calls)
        if self.struck_at is None and self.peer.strikes:
            self.struck_at = step
        if self.struck_at is not None and step == self.struck_at + HOLD_STEPS:
            self.peer.release()


def finish_cleanly(e: Engine, schedule: PeerSchedule) -> None:
    assert schedule.peer.strikes, "the peer never took blocks"
    assert not schedule.problems, f"inconsistent after step {schedule.problems[0]}"
    assert len(e.stats.finished) == len(e.requests)
    assert e.runner.violations == []
    assert_manager_ok(e.scheduler.kv_cache_manager, all_done=True)


def test_peer_takes_blocks_from_running_requests():
    # Four requests decode together; the peer takes blocks when one of them
    # needs a new block, so the scheduler has to preempt.
    e = Engine(HarnessConfig(offload=False, num_gpu_blocks=48, max_num_seqs=4))
    for i in range(4):
        e.add_request([1000 * (i + 1) + t for t in range(120)], max_tokens=40)
    schedule = PeerSchedule(PeerEngine(e.block_pool), arm_step=6)
    e.run(after_step=schedule)
    finish_cleanly(e, schedule)
    assert e.stats.preemptions >= 1


def test_peer_strikes_between_kv_cache_groups():
    # Hybrid: full attention and sliding window groups share the pool. The
    # peer takes blocks after the first group got its blocks and before the
    # second asks, so the first group's blocks must be given back.
    e = Engine(
        HarnessConfig(
            offload=False,
            hybrid=True,
            num_gpu_blocks=64,
            max_num_batched_tokens=64,
        )
    )
    peer = PeerEngine(e.block_pool)
    e.add_request(list(range(100, 400)), max_tokens=8)
    peer.arm(after_calls=1)
    schedule = PeerSchedule(peer, arm_step=-1)
    e.run(after_step=schedule)
    finish_cleanly(e, schedule)
    # Struck at the second call: the sliding window group's first allocation.
    assert peer.strikes[0][0] == 1
