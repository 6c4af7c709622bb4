"""A waiting request with one token left, padded to the speculative width
(ledger rows spec-threshold-cuts-padded-decode, PR vllm#54028, and
spec-async-pad-to-max-model-len, PR vllm#53962).

From 0.25.0 the scheduler pads a request that resumes with one token to
compute (a full prefix hit, a preempted decode) to 1 + k tokens with k
placeholder drafts, so that the step keeps the uniform decode shape of
its full CUDA graph.

- A long_prefill_token_threshold below 1 + k then cut the padded count
  and kept the k drafts: 0.25.0-0.28.0 sent the worker a step of 2 tokens
  with 3 drafts (the sampler reads 1 + drafts rows: outputs diverge), and
  0.29.0-0.33.0 kill EngineCore at `assert num_new_tokens == 1 +
  self.num_spec_tokens` in schedule(). No fix is merged up to 0.33.0.
- Padding to exactly max_model_len leaves no room for the token the step
  samples. Under async scheduling the next step, scheduled before this
  one's output is processed, is capped at max_model_len minus what is
  counted computed minus that token: -1 tokens, and the worker dies in
  np.repeat (0.25.0-0.27.1; here update_from_output's assert on the
  count). 0.28.0 skips the request instead; 0.29.0 pads only where the
  sampled token fits too (PR #53962). And where the padded step would
  not fit at all, 0.25.0-0.28.0 ended the waiting loop on every step with
  a decode running: the request and every one behind it waited for the
  running decodes to finish; 0.29.0 schedules it unpadded.

The fake runner rejects every draft (it samples one token a step), and
raises where a step has fewer tokens than 1 + its drafts.
"""

from __future__ import annotations

import inspect

import pytest

from harness.engine import Engine, HarnessConfig

# Cached by a first request, then hit in full by a request one token
# longer: the hit leaves it one token, which the scheduler pads.
PREFIX = [100 + t for t in range(48)]
K = 3


def decode_then_resume_with_one_token(e: Engine, max_tokens: int) -> str:
    """Cache PREFIX, have a request decoding (padding needs a running
    decode in the step), then add PREFIX + 1 token; return its id."""
    e.add_request(PREFIX, max_tokens=1)
    e.run()
    decoding = e.add_request([7] * 40, max_tokens=20)
    while e.scheduler.requests[decoding].num_computed_tokens <= 40:
        e.step()
    return e.add_request(PREFIX + [5], max_tokens=max_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_threshold_below_the_speculative_width_leaves_the_decode_unpadded(
    async_scheduling,
):
    e = Engine(
        HarnessConfig(
            offload=False,
            num_speculative_tokens=K,
            long_prefill_token_threshold=2,
            async_scheduling=async_scheduling,
        )
    )
    req = decode_then_resume_with_one_token(e, max_tokens=8)
    e.run(max_steps=200)
    assert e.stats.finish_reasons[req] == "LENGTH"
    assert e.runner.violations == []


def test_a_decode_padded_up_to_max_model_len_leaves_room_for_its_token():
    # 48 cached + 1 new token, padded to 4: the step would end at 52.
    e = Engine(
        HarnessConfig(
            offload=False,
            num_speculative_tokens=K,
            async_scheduling=True,
            max_model_len=52,
        )
    )
    req = decode_then_resume_with_one_token(e, max_tokens=52 - 49)
    e.run(max_steps=200)
    assert e.stats.finish_reasons[req] == "LENGTH"
    assert e.runner.violations == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_near_max_model_len_does_not_hold_the_queue(async_scheduling):
    # 48 cached + 1 new token: a padded step would end at 52, past 51.
    e = Engine(
        HarnessConfig(
            offload=False,
            num_speculative_tokens=K,
            async_scheduling=async_scheduling,
            max_model_len=51,
        )
    )
    near = decode_then_resume_with_one_token(e, max_tokens=2)
    behind = e.add_request([9] * 8, max_tokens=2)
    e.step()
    # Both are scheduled at once (the first unpadded), beside the decode.
    assert e.scheduler.requests[near].num_computed_tokens > 0
    assert e.scheduler.requests[behind].num_computed_tokens > 0
    e.run(max_steps=200)
    assert e.runner.violations == []


def pads_waiting_requests() -> bool:
    """Whether this release pads a waiting request to the speculative
    width (0.25.0 on)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return "pad_spec_decode" in inspect.getsource(Scheduler.schedule)


@pytest.mark.parametrize(
    ("threshold", "max_model_len", "padded"),
    [
        (0, 8192, True),
        (1 + K, 8192, True),
        (K, 8192, False),
        # 48 cached + 1 + K rows + the sampled token: 53 fits, 52 does not.
        (0, 53, True),
        (0, 52, False),
    ],
)
def test_the_padding_is_kept_wherever_every_row_and_the_sampled_token_fit(
    threshold, max_model_len, padded
):
    if not pads_waiting_requests():
        pytest.skip("this release pads no waiting request")
    e = Engine(
        HarnessConfig(
            offload=False,
            num_speculative_tokens=K,
            long_prefill_token_threshold=threshold,
            max_model_len=max_model_len,
        )
    )
    req = decode_then_resume_with_one_token(e, max_tokens=2)
    so = e.step()
    assert so is not None and req in so.num_scheduled_tokens
    drafts = so.scheduled_spec_decode_tokens.get(req, [])
    if padded:
        assert (so.num_scheduled_tokens[req], drafts) == (1 + K, [-1] * K)
    else:
        assert (so.num_scheduled_tokens[req], drafts) == (1, [])
