"""Reproducer for patch 0013: under async scheduling, the scheduler does not
preempt a request whose blocks would only be deferred.

From 0.24.0, with overlapped steps and a KV connector that consumes KV, a
request freed while a step in flight computes it gives its blocks back
only once that step is processed. Until 0.30.0 the preemption loop did
not know it: a running request short of a block preempted the
lowest-priority running request, which freed nothing yet, then the next,
until it preempted itself. A step could preempt every running request and
schedule nothing (vllm#49674, fixed by PR #49675).
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig

BS = 16


def test_no_request_is_preempted_for_blocks_that_come_back_later():
    """Three requests decode side by side in a 10-block pool, so that one
    runs out of blocks while the others are in the step in flight."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=10,
            num_cpu_blocks=64,
            async_scheduling=True,
            max_num_batched_tokens=256,
        )
    )
    s = e.scheduler
    preempt = s._preempt_request
    futile: list[str] = []

    def checked_preempt(request, *args, **kwargs):
        fenced = getattr(s, "defer_block_free", False) and (
            request.last_sched_seq > s.processed_step_seq
        )
        if fenced:
            futile.append(f"step {e.stats.steps}: {request.request_id}")
        return preempt(request, *args, **kwargs)

    s._preempt_request = checked_preempt
    for i in range(3):
        e.add_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 20)), max_tokens=40)
    e.run(max_steps=2000)
    assert futile == []
    assert len(e.stats.finished) == 3
