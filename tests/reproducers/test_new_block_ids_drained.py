"""Reproducer for patch 0015: the KV cache manager's record of new block ids
does not grow without bound.

Every full-attention group records the id of each block it allocates, for
the worker to zero when the model has Mamba layers. Up to 0.25.1 the
scheduler takes that record only when the model needs the zeroing, so for
every other model (most of them) it grows by one entry per block
allocated, for as long as the engine runs: about 8 bytes a block, a few
hundred MB a day on a busy server, never given back. Upstream drains it
every step from 0.26.0.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig


def pending_new_block_ids(e: Engine) -> int:
    managers = e.scheduler.kv_cache_manager.coordinator.single_type_managers
    return sum(len(m.new_block_ids) for m in managers)


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_the_new_block_ids_do_not_pile_up(hybrid):
    e = Engine(
        HarnessConfig(block_size=16, hybrid=hybrid, num_gpu_blocks=64, offload=False)
    )
    assert not e.scheduler.needs_kv_cache_zeroing
    for i in range(12):
        e.add_request([1000 * (i + 1) + t for t in range(64)], max_tokens=8)
    while e.busy():
        so = e.step()
        # Nothing is zeroed for a model without Mamba layers...
        assert so is None or so.new_block_ids_to_zero is None
        # ...and nothing is kept for it either.
        assert pending_new_block_ids(e) == 0, (
            f"{pending_new_block_ids(e)} new block ids kept after step "
            f"{e.stats.steps}, for a model that zeroes none"
        )
    assert e.runner.violations == []
