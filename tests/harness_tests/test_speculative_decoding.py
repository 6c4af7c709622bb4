"""The harness under speculative decoding (HarnessConfig.num_speculative_tokens).

Under async scheduling the scheduler counts each step's drafts as computed
until it processes that step's output, so the next step it sends starts
past what the runner computed; the fake runner starts it at its own count,
as a real runner corrects its positions by the accepted count. Without
that correction these workloads read blocks at the wrong positions (the
content checks fail at once under async scheduling): the runs here must end
with every request finished and every check holding, on every release.
Synchronously only a padded request carries drafts (the runner proposes
none): tests/reproducers/test_spec_decode_padding.py has those.
"""

from __future__ import annotations

import random

import pytest

from harness.engine import Engine, HarnessConfig


@pytest.mark.parametrize("offload", [False, True], ids=["no-connector", "offload"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_workload_with_drafts_and_preemptions_runs_clean(async_scheduling, offload):
    rnd = random.Random(0)
    e = Engine(
        HarnessConfig(
            offload=offload,
            num_speculative_tokens=3,
            async_scheduling=async_scheduling,
            # Small enough to preempt, with prefix hits on a shared prefix.
            num_gpu_blocks=24,
            max_num_batched_tokens=64,
        )
    )
    prefix = [rnd.randrange(3, 999) for _ in range(32)]
    for i in range(12):
        tail = [rnd.randrange(3, 999) for _ in range(rnd.randrange(1, 60))]
        e.add_request((prefix if i % 2 else []) + tail, max_tokens=rnd.randrange(1, 30))
    steps_with_drafts = 0
    execute = e.runner.execute

    def counted(so, step):
        nonlocal steps_with_drafts
        steps_with_drafts += bool(so.scheduled_spec_decode_tokens)
        return execute(so, step)

    e.runner.execute = counted  # type: ignore[method-assign]
    e.run(max_steps=2000)
    if async_scheduling:
        # Every decode carries placeholder drafts: the correction is used.
        assert steps_with_drafts > 10
    assert len(e.stats.finished) == 12
    assert e.stats.preemptions > 0
    assert e.runner.violations == []
