"""A streaming-input session preempted while its last step is in flight
(async scheduling): the ledger's preempted-gets-stale-output.

Under async scheduling a step's output is processed after the next step is
scheduled. When that next schedule() preempts a session for KV blocks, the
output of its step in flight still comes in (every release before 0.33.0
delivers it; on 0.19.0-0.26.0 the series' 0016 keeps it as stale output)
and can end the session's current chunk: the session stops with its
computed tokens reset to 0.

- Its next chunk then cut its tokens at the computed ones, 0: the session
  lost its whole context, prompt included, and went on with the new chunk
  alone, while its prompt count still counted the old tokens (silent: the
  model answers without the conversation; later steps see a request whose
  computed tokens never reach its prompt, and the differential's
  async-mixed traces 5968 and 32038 end in "Invalid request status").
- A chunk that came while the session ran was applied by that stop: the
  session went back to the waiting queue, and the removal of the stopped
  preempted requests from that queue, just after, took it out again. In no
  queue, it never ran again.

The patch keeps every token but the final sampled one (computed again when
it runs; a session that was not preempted keeps what it computed, as the
release does), and takes such a session out of the waiting queues before
it is queued again.
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.runner import sampled_token

PROMPT = list(range(300, 314))
CHUNK = list(range(500, 510))


def preempting_engine() -> Engine:
    """Four blocks of 16 tokens (three usable): a 32-token request A that
    decodes, and a session S of 14 tokens that samples one. A's next block
    preempts S while S's only decode step is in flight; that step's output
    ends S's chunk."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=4,
            offload=False,
            prefix_caching=False,
            async_scheduling=True,
        )
    )
    e.add_request(list(range(100, 132)), max_tokens=20, req_id="A")
    e.add_request(PROMPT, max_tokens=1, req_id="S", resumable=True)
    return e


def end_session_and_drain(e: Engine) -> None:
    e.add_request([0], 1, "S")  # a request that is not resumable ends it
    e.run(max_steps=100)
    assert e.runner.violations == []


def test_a_session_stopped_while_preempted_keeps_its_context():
    e = preempting_engine()
    session = e.scheduler.requests["S"]
    e.step_until_waiting_for_input("S", max_steps=100)
    # The premise: preempted, and stopped by the output in flight.
    assert e.stats.preemptions == 1
    assert session.num_computed_tokens < session.num_tokens - 1
    e.abort("A")
    e.add_request(CHUNK, max_tokens=2, req_id="S", resumable=True)
    # The prompt and the chunk; the token sampled last is dropped.
    assert list(session.all_token_ids) == PROMPT + CHUNK
    assert session.num_prompt_tokens == len(PROMPT + CHUNK)
    e.step_until_waiting_for_input("S", max_steps=100)
    position = len(PROMPT + CHUNK)
    assert list(session.all_token_ids[:position]) == PROMPT + CHUNK
    assert session.output_token_ids[0] == sampled_token("S", position)
    # The turn stops once: its step in flight, if any, does not stop it again.
    for _ in range(3):
        e.step()
    queues = (e.scheduler.waiting, getattr(e.scheduler, "skipped_waiting", ()))
    assert sum(r is session for q in queues for r in q) <= 1, "queued twice"
    assert e.scheduler.num_waiting_for_streaming_input == 1
    end_session_and_drain(e)


def test_a_session_given_its_next_chunk_while_preempted_runs_it():
    e = preempting_engine()
    session = e.scheduler.requests["S"]
    e.step()
    assert session.status.name == "RUNNING"
    # The next chunk comes while S runs: it waits in S's streaming queue.
    e.add_request(CHUNK, max_tokens=2, req_id="S", resumable=True)
    while not e.stats.preemptions:
        e.step()
    e.step()  # the output in flight: it ends S's chunk and applies the next
    e.abort("A")
    e.step_until_waiting_for_input("S", max_steps=100)
    assert list(session.all_token_ids[: len(PROMPT + CHUNK)]) == PROMPT + CHUNK
    end_session_and_drain(e)
