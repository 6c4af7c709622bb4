"""Probe for ledger row mamba-align-encoder-cap-stall (vllm#40707): Mamba
"align" prefix caching with a multimodal request whose next item starts
inside a block.

The scheduler caps a chunk where an encoder input it cannot take yet
begins, then the Mamba split floors the chunk to whole blocks. Image A
(positions 0-99) and image B (104-203) each fit the encoder cache (128
slots) alone, not together. The first step computes A and 96 tokens (the
cap at 104, floored to 96). From then on B waits for A's slots, which free
only once position 99 is computed; the cap leaves 104 - 96 = 8 tokens and
the floor makes them 0: no progress, every step, forever. Releases that
align before they cap (upstream PR #51603) let the cap end a chunk inside
the block (104), re-align at the next boundary (112) and finish. Which
outcome is pinned follows the code: the order of the two calls in
Scheduler.schedule. The series carries no fix (ledger: cannot yet)."""

from __future__ import annotations

import inspect

from vllm.v1.core.sched.scheduler import Scheduler

from harness.mamba import mamba_engine

IMAGE = 9
# A at [0, 100), four text tokens, B at [104, 204), sixteen text tokens.
PROMPT = [IMAGE] * 100 + [200, 201, 202, 203] + [IMAGE] * 100 + list(range(300, 316))
ITEMS = [("imgA", 0, 100), ("imgB", 104, 100)]


def aligns_before_the_encoder_cap() -> bool:
    """Whether schedule() runs the Mamba split before it schedules encoder
    inputs (the fix's order)."""
    source = inspect.getsource(Scheduler.schedule)
    return source.index("_mamba_block_aligned_split(") < source.index(
        "_try_schedule_encoder_inputs("
    )


def test_a_chunk_capped_inside_a_mamba_block_progresses_where_aligned_first():
    # Full attention + Mamba "align" 16, a 128-token budget (the harness
    # sizes the encoder budget and cache from it); a skip where the release
    # has no align mode.
    e = mamba_engine("align", num_gpu_blocks=64, offload=False)
    req_id = e.add_request(PROMPT, max_tokens=2, mm=ITEMS)
    request = e.scheduler.requests[req_id]
    if aligns_before_the_encoder_cap():
        e.run(max_steps=40)
        assert req_id in e.stats.finished
        return
    for _ in range(40):
        e.step()
    # Stalled: A and the first six blocks computed, and nothing since.
    assert req_id not in e.stats.finished and e.busy()
    assert request.num_computed_tokens == 96
