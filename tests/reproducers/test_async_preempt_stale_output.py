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


def async_engine(num_gpu_blocks: int = 8, **overrides) -> Engine:
    """Async scheduling without prefix caching or a connector, on a pool of
    `num_gpu_blocks` blocks of 16 tokens."""
    return Engine(
        HarnessConfig(
            num_gpu_blocks=num_gpu_blocks,
            offload=False,
            prefix_caching=False,
            async_scheduling=True,
            **overrides,
        )
    )


def two_decoders_finish(e: Engine) -> None:
    """Two 48-token prompts decoding 40 tokens each, more than the pool
    holds to the end: one is preempted with steps in flight. Both finish,
    each with the tokens sampled at its own positions, once each."""
    a = e.add_request(list(range(100, 100 + PROMPT_LEN)), max_tokens=MAX_TOKENS)
    b = e.add_request(list(range(200, 200 + PROMPT_LEN)), max_tokens=MAX_TOKENS)
    e.run(max_steps=500)
    assert e.stats.preemptions >= 1
    assert {a, b} <= e.stats.finished
    for req_id in (a, b):
        want = [sampled_token(req_id, PROMPT_LEN + i) for i in range(MAX_TOKENS)]
        assert list(e.requests[req_id].output_token_ids) == want, req_id
    assert e.runner.violations == []


@pytest.mark.parametrize("num_gpu_blocks", [8, 10])
def test_a_request_preempted_with_two_steps_in_flight_finishes(num_gpu_blocks):
    """On 8 or 10 blocks, with three pipeline stages: two of the preempted
    request's steps are in flight."""
    two_decoders_finish(async_engine(num_gpu_blocks, pipeline_parallel_size=3))


def test_a_request_finished_by_its_in_flight_output_leaves_the_queues():
    """The preempted request's last tokens are in flight: their output
    finishes it while it waits, skipped by the waiting scan until that
    output is in. It must leave the waiting queues as it ends: a finished
    request left there stops the next schedule ("Invalid request status")."""
    e = async_engine(pipeline_parallel_size=3)
    a = e.add_request(list(range(100, 148)), max_tokens=MAX_TOKENS)
    b = e.add_request(list(range(200, 232)), max_tokens=17)
    e.run(max_steps=500)
    assert e.stats.preemptions >= 1
    assert {a, b} <= e.stats.finished
    assert list(e.requests[b].output_token_ids) == [
        sampled_token(b, 32 + i) for i in range(17)
    ]
    assert e.runner.violations == []


def test_an_async_scheduler_counts_its_steps_in_flight_whatever_its_config_says(
    monkeypatch: pytest.MonkeyPatch,
):
    """vLLM's own tests build an AsyncScheduler whose config has async
    scheduling off (the CPU platform turns it off) and schedule with a step
    in flight. Such a scheduler must count its steps in flight as one built
    for async scheduling does: a request preempted with a step in flight
    has its placeholders reset, and output not marked stale would take them
    below zero. Driven as EngineCore drives an AsyncScheduler (a batch queue
    of two)."""
    import harness.engine

    make_vllm_config = harness.engine.make_vllm_config

    def async_scheduling_off(cfg: HarnessConfig):
        config = make_vllm_config(cfg)
        config.scheduler_config.async_scheduling = False
        return config

    monkeypatch.setattr(harness.engine, "make_vllm_config", async_scheduling_off)
    e = async_engine()
    assert not e.vllm_config.scheduler_config.async_scheduling
    two_decoders_finish(e)


def test_a_scheduler_built_without_init_counts_its_steps_in_flight():
    """vLLM's own tests build schedulers with object.__new__ and set only
    the attributes they use, then schedule and process output (as
    test_abort_request_when_structured_output_fsm_cannot_advance does): the
    series' switch for the count must have a class default, and that
    default must count, since such a caller may schedule with steps in
    flight. The engine's scheduler is replaced by a copy made so, without
    the switch, and driven under async scheduling with a preemption."""
    # The reservations' recount wraps the built scheduler's methods.
    e = async_engine(check_reservations=False)
    built = e.scheduler
    bare = object.__new__(type(built))
    vars(bare).update(
        (name, value)
        for name, value in vars(built).items()
        if name != "count_steps_in_flight"
    )
    e.scheduler = bare
    two_decoders_finish(e)
