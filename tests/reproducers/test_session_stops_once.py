"""A streaming-input session stopped with a step in flight (async
scheduling): the ledger's session-stop-counted-twice.

Under async scheduling a step's output is processed after the next step is
scheduled, so a session that stops on a stop token has a step of the turn
that just ended in flight. Every release before 0.31.0 delivered that
step's output to the session:

- its token was appended after the stop, and after the session's next
  chunk where the stop applied one, as the first token of the new turn;
- where it reached max_tokens it stopped the session a second time: the
  session was queued twice, and counted twice among the sessions waiting
  for input, which its close takes off once. The count is subtracted from
  the unfinished requests (EngineCore steps only while there are some)
  and, from 0.25.0, added to the running ones at admission.

The patch drops that output: the stop marks the steps in flight stale, to
be dropped as they come back.
"""

from __future__ import annotations

from vllm.v1.request import Request

from harness.engine import Engine, HarnessConfig
from harness.engine_core import step_as_engine_core
from harness.runner import sampled_token

PROMPT = list(range(20))
CHUNK = list(range(700, 710))
# Where the next turn's tokens start: the prompt, the stop token (sampled at
# 20, computed by the step in flight at the stop and kept, as the release
# keeps it) and the chunk.
START = len(PROMPT) + 1 + len(CHUNK)


def session_given_a_chunk_while_it_runs(
    cfg: HarnessConfig, max_tokens: int, other_tokens: int, stop: bool = True
) -> tuple[Engine, Request]:
    """Session s (PROMPT; with `stop`, it stops on its first sampled token)
    runs beside a 30-token request; its next chunk comes after the first
    step, while it runs, so its stop applies the chunk."""
    e = Engine(cfg)
    stop_at = len(PROMPT) if stop else None
    e.add_request(PROMPT, max_tokens, "s", resumable=True, stop_at=stop_at)
    e.add_request(list(range(100, 130)), other_tokens, "other")
    e.step()
    e.add_request(CHUNK, max_tokens, "s", resumable=True)
    return e, e.scheduler.requests["s"]


def step_until_the_chunk_is_applied(e: Engine, session: Request) -> None:
    for _ in range(20):
        if len(session.prompt_token_ids) > len(PROMPT):
            return
        e.step()
    raise AssertionError("the chunk was never applied")


def assert_the_next_turn_is_the_sessions(session: Request, num_tokens: int) -> None:
    """The prompt, the stop token and the chunk, then `num_tokens` of the
    next turn, each sampled at its own position."""
    tokens = list(session.all_token_ids)
    assert tokens[:START] == [*PROMPT, sampled_token("s", len(PROMPT)), *CHUNK]
    assert tokens[START:] == [sampled_token("s", START + i) for i in range(num_tokens)]


def stop_a_session_twice(e: Engine, k: int) -> str:
    """A 20-token session that stops on its first sampled token, with its
    second step, whose token reaches max_tokens (2), in flight; a request
    runs beside it, as traffic does. Its client then closes it."""
    session = e.add_request(
        [1000 * (k + 1) + t for t in range(20)], 2, f"s{k}", resumable=True, stop_at=20
    )
    e.add_request([1000 * (k + 1) + 500 + t for t in range(30)], 8)
    for _ in range(10):
        e.step()
    e.add_request([0], 1, session)  # a request that is not resumable ends it
    for _ in range(20):
        e.step()
    return session


def test_sessions_stopped_by_output_in_flight_leave_the_engine_serving():
    e = Engine(HarnessConfig(offload=False, async_scheduling=True, max_num_seqs=2))
    # The release queues such a session twice (the test below): this one is
    # about what the count does after.
    e.raise_queue_violations = False
    for k in range(2):
        stop_a_session_twice(e, k)
    assert e.scheduler.num_waiting_for_streaming_input == 0
    new = {e.add_request([5000 + 100 * i + t for t in range(16)], 4) for i in range(4)}
    # Bare 0.19.0-0.24.0: the engine stops stepping with 2 of the 4 running;
    # 0.25.0-0.30.0: none is admitted, and it steps for ever.
    step_as_engine_core(e, max_steps=60)
    assert new <= e.stats.finished


def test_a_second_stop_by_output_in_flight_queues_a_session_once():
    e = Engine(HarnessConfig(offload=False, async_scheduling=True))
    e.raise_queue_violations = False
    e.add_request(list(range(20)), 2, "s", resumable=True, stop_at=20)
    e.add_request(list(range(100, 130)), 8, "other")
    for _ in range(10):
        e.step()
    assert e.queue_violations == []
    assert e.scheduler.num_waiting_for_streaming_input == 1
    # Waiting for input with no step in flight: nothing is left on the
    # counters of the output it did not get.
    session = e.scheduler.requests["s"]
    assert session.num_output_placeholders == 0
    assert session.num_computed_tokens == session.num_tokens


def test_a_chunk_given_while_the_session_ran_starts_its_turn_with_its_own_token():
    """The chunk is queued while the session runs, so its stop applies it;
    the first token of the new turn is the one sampled after the chunk, not
    the one the ended turn's step in flight sampled."""
    cfg = HarnessConfig(offload=False, async_scheduling=True)
    e, session = session_given_a_chunk_while_it_runs(cfg, 4, 8)
    step_until_the_chunk_is_applied(e, session)
    # The session goes on at once, as in the release: the step in flight
    # holds back nothing but its own output.
    so = e.step()
    assert so is not None and "s" in so.num_scheduled_tokens
    e.step_until_waiting_for_input("s")
    # Its max_tokens (4), and nothing left in flight on its counters.
    assert_the_next_turn_is_the_sessions(session, 4)
    assert session.num_output_placeholders == 0
    assert e.runner.violations == []


def test_a_session_stopped_with_drafts_in_flight_computes_its_next_chunk():
    """Drafts were scheduled with the step in flight at the stop: its
    computed tokens ran past the session's tokens, and the dropped output
    no longer rolls them back. The chunk must be computed from where the
    session's own tokens end."""
    cfg = HarnessConfig(offload=False, async_scheduling=True)
    e, session = session_given_a_chunk_while_it_runs(cfg, 4, 8)
    session.spec_token_ids = [7, 8]
    so = e.step()  # s decodes with the drafts, and then stops
    assert so is not None and so.scheduled_spec_decode_tokens.get("s") == [7, 8]
    e.run(max_steps=100)
    # (The fake runner keeps no drafts: it takes the KV the drafts wrote
    # past a block's computed tokens for a wrong read, so its violations
    # are not checked here.) The chunk's last token samples the new turn's
    # first: at the chunk's end, where the whole chunk was computed.
    assert_the_next_turn_is_the_sessions(session, 4)


def test_a_session_that_reaches_max_tokens_keeps_the_first_token_of_its_next_turn():
    """A stop by max_tokens leaves no step in flight (none is scheduled past
    max_tokens): nothing is to be dropped, and the first output of the next
    turn is the session's."""
    cfg = HarnessConfig(offload=False, async_scheduling=True)
    e, session = session_given_a_chunk_while_it_runs(cfg, 2, 8, stop=False)
    e.run(max_steps=100)
    assert session.status.name == "WAITING_FOR_STREAMING_REQ"
    # Its 2 tokens, the last (never computed) cut by the chunk, then the
    # chunk and the 2 tokens of the next turn.
    assert_the_next_turn_is_the_sessions(session, 2)


def test_a_session_preempted_with_its_ended_turn_in_flight_gets_none_of_it():
    """Four pipeline stages keep up to four steps in flight: the session
    resumes with its next chunk while two steps of the turn it stopped are
    still in flight, and a preemption for blocks (five usable) resets it.
    The output of those steps must still be dropped, with that of the steps
    the preemption resets; the tokens the session ends with are its own."""
    cfg = HarnessConfig(
        offload=False,
        prefix_caching=False,
        async_scheduling=True,
        pipeline_parallel_size=4,
        num_gpu_blocks=6,
    )
    e, session = session_given_a_chunk_while_it_runs(cfg, 8, 40)
    e.run(max_steps=200)
    assert e.stats.preemptions >= 1
    assert_the_next_turn_is_the_sessions(session, 8)


def test_a_session_reset_with_its_ended_turn_in_flight_gets_none_of_it():
    """As above, with a reset of the prefix cache (a weight update) where
    the preemption was: it preempts the session while steps of its ended
    turn are in flight."""
    cfg = HarnessConfig(offload=False, async_scheduling=True, pipeline_parallel_size=4)
    e, session = session_given_a_chunk_while_it_runs(cfg, 8, 16)
    step_until_the_chunk_is_applied(e, session)
    e.step()  # the session resumes, the ended turn's steps still in flight
    assert session.status.name == "RUNNING"
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.run(max_steps=200)
    assert_the_next_turn_is_the_sessions(session, 8)
