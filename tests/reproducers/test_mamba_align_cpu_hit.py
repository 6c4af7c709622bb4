"""Reproducer for the Mamba align-mode CPU hit (ledger row
mamba-align-external-hit-assert).

On 0.19.0-0.22.1 the scheduler's block-aligned split for a Mamba hybrid in
'align' mode asserts that no KV connector reports external tokens
("External KV connector is not verified yet"): any CPU hit of
SimpleCPUOffload, or any P/D load, kills EngineCore (vllm#45268, #41515,
#45407, #43508). With the fix an async load is admitted without the
split (it computes nothing in that step) and the request's computation
after the load is split as any other, block-aligned.
"""

from __future__ import annotations

import pytest

from harness.mamba import PROMPT, mamba_engine, prompt_on_the_cpu_only
from harness.offload_checks import loaded_blocks

# 70 tokens past the 48 on the CPU: the computation after the load is cut
# at the last block boundary (112), then the rest.
EXTENSION = list(range(900, 970))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_cpu_hit_on_a_mamba_align_hybrid_is_loaded(async_scheduling):
    e = mamba_engine("align", async_scheduling=async_scheduling)
    prompt_on_the_cpu_only(e)
    req_id = e.add_request(PROMPT + EXTENSION, max_tokens=2)
    assert loaded_blocks(e), "the prompt's prefix is loaded from the CPU"
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []


def test_the_computation_after_the_load_is_block_aligned():
    e = mamba_engine("align")
    prompt_on_the_cpu_only(e)
    req_id = e.add_request(PROMPT + EXTENSION, max_tokens=2)
    chunks = []
    for _ in range(100):
        if not e.busy():
            break
        so = e.step()
        if so is not None and req_id in so.num_scheduled_tokens:
            chunks.append(so.num_scheduled_tokens[req_id])
    # 48 loaded, then 64 to the block boundary at 112, then the last 6;
    # then the decode step.
    assert chunks[:2] == [64, 6], chunks
    assert e.runner.violations == [] and e.cuda.races == []
