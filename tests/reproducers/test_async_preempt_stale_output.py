"""A request preempted with steps in flight (async scheduling, pipeline
parallelism): the ledger's async-preempt-placeholder-underflow.

Under async scheduling a decode step adds its token to the request's output
placeholders and computed tokens when it is scheduled; its output takes the
placeholders off when it is processed. With three pipeline stages (or
speculative decoding) two steps of a request can be in flight when the next
schedule() preempts it for KV blocks. The preemption resets its computed
tokens but not its placeholders, and the request is resumed before the
output of those steps is in: that output, then the resumed prefill's, take
off more placeholders than are left, and the engine dies on `assert
request.num_output_placeholders >= 0` (vllm#41190; upstream fixed it in
0.27.0, vllm#48245). The patch marks the output in flight at a preemption
as stale: its tokens are kept, it leaves the reset counters alone, and the
request is resumed only once it is in, so each position is sampled once.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.runner import sampled_token

PROMPT_LEN = 48
MAX_TOKENS = 40


@pytest.mark.parametrize("num_gpu_blocks", [8, 10])
def test_a_request_preempted_with_two_steps_in_flight_finishes(num_gpu_blocks):
    """Two 48-token prompts decoding 40 tokens each on 8 or 10 blocks of 16
    tokens: the pool cannot hold both to the end, so one is preempted while
    two of its steps are in flight (three pipeline stages). Both finish,
    each with the tokens sampled at its own positions, once each."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=num_gpu_blocks,
            offload=False,
            prefix_caching=False,
            async_scheduling=True,
            pipeline_parallel_size=3,
        )
    )
    a = e.add_request(list(range(100, 100 + PROMPT_LEN)), max_tokens=MAX_TOKENS)
    b = e.add_request(list(range(200, 200 + PROMPT_LEN)), max_tokens=MAX_TOKENS)
    e.run(max_steps=500)
    assert e.stats.preemptions >= 1
    assert {a, b} <= e.stats.finished
    for req_id in (a, b):
        want = [sampled_token(req_id, PROMPT_LEN + i) for i in range(MAX_TOKENS)]
        assert list(e.requests[req_id].output_token_ids) == want, req_id
    assert e.runner.violations == []


def test_a_request_finished_by_its_in_flight_output_leaves_the_queues():
    """The preempted request's last tokens are in flight: their output
    finishes it while it waits, skipped by the waiting scan until that
    output is in. It must leave the waiting queues as it ends: a finished
    request left there stops the next schedule ("Invalid request status")."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=8,
            offload=False,
            prefix_caching=False,
            async_scheduling=True,
            pipeline_parallel_size=3,
        )
    )
    a = e.add_request(list(range(100, 148)), max_tokens=MAX_TOKENS)
    b = e.add_request(list(range(200, 232)), max_tokens=17)
    e.run(max_steps=500)
    assert e.stats.preemptions >= 1
    assert {a, b} <= e.stats.finished
    assert list(e.requests[b].output_token_ids) == [
        sampled_token(b, 32 + i) for i in range(17)
    ]
    assert e.runner.violations == []
