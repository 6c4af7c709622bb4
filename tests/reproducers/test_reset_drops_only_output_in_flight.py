"""A prefix-cache reset under async scheduling drops the output its
preempted requests have in flight, and nothing else: the ledger's
reset-keeps-async-output.

`reset_prefix_cache(reset_running_requests=True)` (an RL weight update,
`pause_generation(mode="keep")` with its default clear_cache, sleep mode)
preempts every running request. The output of their steps still in flight
was sampled before the reset and must not reach them. Up to 0.21.0 the
reset marks each preempted request to drop its next output, whatever is
in flight: after an engine that drained first (a pause waits for its steps)
that is the first token sampled after the request resumes, and every later
token lands one position early, silently (vllm#42043, fixed upstream in
0.22.0 by counting what is in flight, vllm#42117); with two steps in flight
(pipeline stages) one request keeps a pre-reset token and another, resumed
into a prefill chunk, takes its placeholders below 0 and EngineCore dies on
the assertion. Without async scheduling (the plain Scheduler, pipeline
stages) the release keeps that output and resumes the request before it is
in: its tokens land at wrong positions (until 0.27.0). The patch skips
exactly the output of the steps in flight at the reset, which 0016 already
counts per request, in both schedulers.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness.engine import Engine, HarnessConfig
from harness.runner import sampled_token

PROMPT = list(range(100, 148))
LONG_PROMPT = list(range(1000, 1000 + 200))
MAX_TOKENS = 20


def drain(e: Engine) -> None:
    """Process the output of every step in flight, scheduling nothing: what
    EngineCore does while a pause waits for its steps to finish."""
    while e.in_flight:
        so, out, mark = e.in_flight.popleft()
        e.cuda.host_sync(mark)
        e._process(so, out)


def run_reset(
    stages: int, drained: bool, async_scheduling: bool = True, steps: int = 6
) -> tuple[Engine, str, str, int]:
    """A decoding and B in the middle of a chunked prefill when the reset
    comes (`steps` in); both run to the end. Returns the engine, both
    request ids and the steps in flight at the reset."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=64,
            offload=False,
            async_scheduling=async_scheduling,
            pipeline_parallel_size=stages,
            max_num_batched_tokens=64,
        )
    )
    a = e.add_request(PROMPT, max_tokens=MAX_TOKENS)
    b = e.add_request(LONG_PROMPT, max_tokens=MAX_TOKENS)
    for _ in range(steps):
        e.step()
    if drained:
        drain(e)
    in_flight = len(e.in_flight)
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    # The output of the steps in flight comes back first, one a step: none
    # of its tokens, sampled before the reset, reaches a request.
    before = {r: len(e.requests[r].output_token_ids) for r in (a, b)}
    for _ in range(in_flight):
        e.step()
    assert {r: len(e.requests[r].output_token_ids) for r in (a, b)} == before
    e.run(max_steps=300)
    return e, a, b, in_flight


def assert_each_token_at_its_position(e: Engine, *req_ids: str) -> None:
    for req_id, prompt in zip(req_ids, (PROMPT, LONG_PROMPT), strict=True):
        want = [sampled_token(req_id, len(prompt) + i) for i in range(MAX_TOKENS)]
        assert list(e.requests[req_id].output_token_ids) == want, req_id


@pytest.mark.parametrize("stages", [1, 3])
def test_a_reset_after_the_engine_drained_drops_no_token(stages):
    """Nothing in flight at the reset: every token the requests are given
    is sampled after it, at its own position."""
    e, a, b, in_flight = run_reset(stages, drained=True)
    assert in_flight == 0
    assert {a, b} <= e.stats.finished
    assert_each_token_at_its_position(e, a, b)


def test_a_reset_with_two_steps_in_flight_drops_both():
    """Three pipeline stages keep two steps in flight at the reset: the
    output of both is dropped, not only the first."""
    e, a, b, in_flight = run_reset(stages=3, drained=False)
    assert in_flight == 2
    assert {a, b} <= e.stats.finished
    assert_each_token_at_its_position(e, a, b)


@pytest.mark.parametrize("steps", [5, 7])
def test_a_reset_without_async_scheduling_drops_the_pipelines_output(steps):
    """Three pipeline stages without async scheduling (the plain Scheduler):
    a step of A's is in flight at the reset. Its output, sampled before the
    reset, is dropped too; the release kept it, and A resumed before it
    was in."""
    e, a, b, in_flight = run_reset(
        3, drained=False, async_scheduling=False, steps=steps
    )
    assert in_flight >= 1
    assert {a, b} <= e.stats.finished
    assert_each_token_at_its_position(e, a, b)


def test_a_reset_with_one_step_in_flight_drops_it():
    """Plain async scheduling, one step in flight: its output is dropped
    (what the release already does; kept here as the case the fix must not
    change)."""
    e, a, b, in_flight = run_reset(stages=1, drained=False)
    assert in_flight == 1
    assert {a, b} <= e.stats.finished
    assert_each_token_at_its_position(e, a, b)


@pytest.mark.parametrize(
    ("async_scheduling", "num_gpu_blocks", "num_requests"),
    # The plain Scheduler preempts a request with a step in flight in
    # fewer configurations: three requests on 9 blocks do.
    [(True, 10, 2), (False, 9, 3)],
)
def test_a_preemption_after_a_reset_keeps_its_output_in_flight(
    async_scheduling, num_gpu_blocks, num_requests
):
    """A reset, then KV pressure preempts a request with steps in flight
    (three pipeline stages, 48-token prompts decoding 40 tokens on a few
    blocks): that output was sampled after the reset and is kept, as any
    preemption's (0016), not dropped and sampled again. Only the reset's
    own stale output is dropped: under either scheduler, the reset's mark
    ends at the request's next preemption."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=num_gpu_blocks,
            offload=False,
            prefix_caching=False,
            async_scheduling=async_scheduling,
            pipeline_parallel_size=3,
        )
    )
    req_ids = [
        e.add_request(list(range(100 + 100 * j, 148 + 100 * j)), max_tokens=40)
        for j in range(num_requests)
    ]
    if not hasattr(e.requests[req_ids[0]], "num_stale_steps"):
        pytest.skip("watches the series' count of stale steps (patch 0016)")
    for _ in range(4):
        e.step()
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    for _ in range(3):  # the reset's stale output comes back
        e.step()
    # Output tokens of a preempted request when first seen with stale steps,
    # and how many it gained once they were all in.
    seen: dict[str, int] = {}
    kept: list[int] = []

    def watch(e: Engine) -> None:
        for req_id, req in e.scheduler.requests.items():
            if req.status != RequestStatus.PREEMPTED:
                continue
            if req.num_stale_steps > 0:
                seen.setdefault(req_id, len(req.output_token_ids))
            elif req_id in seen:
                kept.append(len(req.output_token_ids) - seen.pop(req_id))

    e.run(max_steps=500, after_step=watch)
    assert kept and all(n > 0 for n in kept), kept
    assert set(req_ids) <= e.stats.finished
    for req_id in req_ids:
        want = [sampled_token(req_id, 48 + i) for i in range(40)]
        assert list(e.requests[req_id].output_token_ids) == want, req_id
