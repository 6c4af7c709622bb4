"""Tests written for semantic mutants (scripts/data/semantic_mutants.toml)
that no reproducer killed: each names the mutants it kills. make mutate runs
this file with every series' reproducers; each test passes on every series
it runs on."""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.offload_checks import lost_or_wrong_cpu_blocks

BS = 16


def test_a_finish_with_more_unstored_blocks_than_free_cpu_blocks():
    """A request finishes in the step that computes its whole prompt, so
    none of its blocks was stored, with fewer CPU blocks free than it has
    blocks. The flush on finish (0004; upstream's from 0.30.0) stores what
    the free CPU blocks hold and leaves no GPU or CPU ref behind.

    Kills 0004-flush-ignores-free-cpu-blocks (the CPU pool refuses the
    whole flush from request_finished) and
    0004-flush-refs-blocks-it-does-not-store (the blocks cut off keep the
    GPU ref taken before the cut)."""
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=32,
        num_cpu_blocks=3,
        max_num_batched_tokens=8 * BS,
    )
    e = Engine(cfg)
    a = e.add_request(list(range(100, 100 + 6 * BS + 1)), max_tokens=1)
    e.run()
    assert a in e.stats.finished
    assert e.runner.violations == []
    # The CPU holds only part of the prompt: what it holds must be right.
    assert [x for x in lost_or_wrong_cpu_blocks(e, [a]) if "wrong" in x] == []
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )
