"""Reproducer for the shrinking-drafts patch: a Mamba align-mode request
asked for fewer blocks than it holds gets none, instead of an assertion
that kills the engine.

With speculative decoding whose number of drafts changes from step to
step (suffix or n-gram decoding), a step allocates for its token and all
its drafts. When every draft is rejected and the next step asks for
fewer, MambaManager in align mode holds more blocks than that step needs.
Up to 0.22.1 it asserts `num_required_blocks N < len(req_blocks) M`; the
AssertionError leaves Scheduler.schedule() and EngineCore dies
(vllm#39271, fixed by vllm#39562 in 0.23.0). The harness has no drafter:
the allocate_slots calls stand for the scheduler's, made as it makes them
when the draft count drops.
"""

from __future__ import annotations

from harness.mamba import PROMPT, mamba_engine

DRAFTS = 20


def test_a_request_asked_for_fewer_blocks_than_it_holds_gets_none():
    e = mamba_engine("align", offload=False)
    free_at_start = e.block_pool.get_num_free_blocks()
    r = e.add_request(PROMPT, max_tokens=8)
    req = e.requests[r]
    while req.num_computed_tokens < len(PROMPT):  # one chunk or more
        e.step()
    manager = e.scheduler.kv_cache_manager
    computed = req.num_computed_tokens
    assert manager.allocate_slots(req, 1 + DRAFTS) is not None
    # Every draft rejected: the step computed one token; the next asks for
    # one token and no draft, fewer blocks than the request holds.
    req.num_computed_tokens = computed + 1
    held = manager.get_block_ids(r)
    fewer = manager.allocate_slots(req, 1)
    assert fewer is not None
    assert all(not blocks for blocks in fewer.get_block_ids()), (
        f"blocks allocated for a request that holds more than it needs: {fewer}"
    )
    # The blocks given for the drafts stay with the request (a skipped
    # state block may go, as in any step: compare lengths and the last).
    now = manager.get_block_ids(r)
    assert [len(g) for g in now] == [len(g) for g in held], (held, now)
    assert [g[-1] for g in now] == [g[-1] for g in held], (held, now)
    # The drafts grow past what it holds: one block more, after the shrink...
    req.num_computed_tokens = computed + 2
    more = manager.allocate_slots(req, 1 + DRAFTS + 16)
    assert more is not None
    assert all(len(g) == 1 for g in more.get_block_ids()), more
    # ...and gives every block back when it goes.
    manager.free(req)
    assert e.block_pool.get_num_free_blocks() == free_at_start
