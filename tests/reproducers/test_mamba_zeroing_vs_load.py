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

from typing import get_args

import pytest

from harness.engine import Engine, HarnessConfig

PROMPT = list(range(100, 148))  # three blocks of 16


def mamba_engine(mode: str, **overrides) -> Engine:
    """A full-attention + Mamba layout with SimpleCPUOffload, or a skip
    where the release has no such mode."""
    from vllm.config.cache import MambaCacheMode

    if mode not in get_args(MambaCacheMode):
        pytest.skip(f"this release has no mamba_cache_mode {mode!r}")
    cfg = dict(
        mamba=mode, num_gpu_blocks=32, num_cpu_blocks=32, max_num_batched_tokens=128
    )
    return Engine(HarnessConfig(**(cfg | overrides)))


def run_collecting(e: Engine, mode: str) -> tuple[set[int], set[int]]:
    """Run `e` until idle; the blocks named for zeroing and those loaded."""
    zeroed: set[int] = set()
    loaded: set[int] = set()
    try:
        while e.busy():
            so = e.step()
            if so is None:
                continue
            zeroed |= set(so.new_block_ids_to_zero or ())
            loaded |= set(so.kv_connector_metadata.load_gpu_blocks)
    except AssertionError as error:
        # 0.19.0-0.22.1 stop a KV connector's load with an align group.
        if "External KV connector is not verified yet" not in str(error):
            raise
        pytest.skip(f"this release refuses a load with a Mamba {mode} group")
    return zeroed, loaded


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["align", "all"])
def test_a_loads_destination_is_never_zeroed(mode, async_scheduling):
    e = mamba_engine(mode, async_scheduling=async_scheduling)
    e.add_request(PROMPT, max_tokens=3)
    e.run()
    assert e.block_pool.reset_prefix_cache()  # only the CPU has the prompt
    e.add_request(PROMPT + list(range(900, 917)), max_tokens=2)
    zeroed, loaded = run_collecting(e, mode)
    assert loaded, "the extension loads its prefix from the CPU"
    assert e.cuda.races == [], "a zeroing and a load wrote one block unordered"
    assert not zeroed & loaded, "a block was named for zeroing and loaded"
    assert e.runner.violations == []
    # The blocks the extension computes itself are still zeroed first.
    assert zeroed, "the blocks the request computes are zeroed"
