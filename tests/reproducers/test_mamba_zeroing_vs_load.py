"""Reproducer for patch 0014: a Mamba hybrid never zeroes a block a CPU
load is writing.

A model with Mamba layers asks the worker to zero the attention blocks the
scheduler allocates (SchedulerOutput.new_block_ids_to_zero): a new block can
hold another layer type's bytes. A request whose prefix is on the CPU is
admitted as an async load and takes new blocks for that prefix; up to
0.25.1 the scheduler names those blocks for zeroing too. The worker zeroes
them on the compute stream while SimpleCPUOffload's load writes them on its
own stream, which waits for nothing: whichever lands last wins, and the
request may attend to zeros where its prefix should be, with no error
(vllm-project/vllm#48481, fixed in 0.26.0). The fake CUDA's checker
reports two writes to one block that no event orders.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine
from harness.mamba import (
    PROMPT,
    attention_blocks,
    mamba_engine,
    prompt_on_the_cpu_only,
    skip_where_a_load_is_refused,
)


def run_collecting(e: Engine, mode: str) -> tuple[set[int], set[int], set[int]]:
    """Run `e` until idle; the blocks named for zeroing, those loaded, and
    those named for zeroing in the step that loads them."""
    zeroed: set[int] = set()
    loaded: set[int] = set()
    both: set[int] = set()
    with skip_where_a_load_is_refused(mode):
        # Bounded: a request that never leaves the waiting queue (a stalled
        # mutant) fails the test instead of hanging it.
        for _ in range(1_000):
            if not e.busy():
                break
            so = e.step()
            if so is None:
                continue
            zero = set(so.new_block_ids_to_zero or ())
            load = set(so.kv_connector_metadata.load_gpu_blocks)
            zeroed |= zero
            loaded |= load
            both |= zero & load
        else:
            raise AssertionError("still busy after 1,000 steps")
    return zeroed, loaded, both


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_loads_destination_is_never_zeroed(mode, async_scheduling):
    e = mamba_engine(mode, async_scheduling=async_scheduling)
    prompt_on_the_cpu_only(e)
    e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    # A request admitted in the same step computes its own new blocks: those
    # are still zeroed.
    e.add_request(list(range(500, 540)), max_tokens=2)
    zeroed, loaded, both = run_collecting(e, mode)
    assert loaded, "the extension loads its prefix from the CPU"
    assert e.cuda.races == [], "a zeroing and a load wrote one block unordered"
    assert not both, "a block was named for zeroing in the step that loads it"
    assert e.runner.violations == []
    assert zeroed - loaded, "the blocks requests compute are zeroed"


@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_loaded_block_given_to_another_request_is_zeroed_for_it(mode):
    """Only the step that loads a block leaves it out of the zeroing: once
    the load's request has finished and its blocks are free, a request that
    computes into them gets them zeroed first."""
    e = mamba_engine(mode)
    prompt_on_the_cpu_only(e)
    r = e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    with skip_where_a_load_is_refused(mode):
        e.step()
    # The attention blocks the load writes (the Mamba group's are never
    # zeroed).
    loaded = attention_blocks(e, r)
    run_collecting(e, mode)
    assert loaded
    assert e.block_pool.reset_prefix_cache()  # every block is free again
    # Requests one after another: each takes blocks from the head of the
    # free queue and gives them back at its tail, so the queue turns until
    # the loaded blocks serve the attention group again.
    computed_in: set[int] = set()
    zeroed: set[int] = set()
    for i in range(12):
        e.add_request([3000 + 100 * i + t for t in range(48)], max_tokens=2)
        while e.busy():
            so = e.step()
            if so is None:
                continue
            zeroed |= set(so.new_block_ids_to_zero or ())
            for req_id in so.num_scheduled_tokens:
                computed_in |= attention_blocks(e, req_id)
    reused = computed_in & loaded
    assert reused, "the requests got some of the loaded blocks"
    assert reused <= zeroed, "a block the load wrote was not zeroed for its next user"
    assert e.runner.violations == [] and e.cuda.races == []


@pytest.mark.parametrize("mode", ["align", "all"])
def test_only_the_attention_groups_new_blocks_are_zeroed(mode):
    """The worker zeroes the new blocks of the attention groups, each once,
    and never the Mamba group's, whose state it would wipe."""
    e = mamba_engine(mode)
    r = e.add_request(PROMPT, max_tokens=3)
    so = e.step()
    zeroed = so.new_block_ids_to_zero or []
    assert len(zeroed) == len(set(zeroed))
    assert set(zeroed) == attention_blocks(e, r) != set()
    e.run()
    assert e.runner.violations == [] and e.cuda.races == []
