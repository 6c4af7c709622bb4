"""Reproducers: a block hashed after its request was created keys every
multimodal item in it (ledger row prefix-hash-mm-resumed).

A request's block hashes are computed when it is created, for the full
blocks of its prompt, and then one block at a time as tokens complete
more: output tokens, or a streaming session's next chunk. Up to 0.30.0
that later hashing starts its search for the block's multimodal items at
the request's last item, assuming only the last one can reach past the
blocks already hashed. Two kinds of block break that assumption: the
prompt's partial last block holding two items (completed by the output),
and a session's next chunk bringing two items or more (every item but the
last is then in no block's hash). Such a block hashes as if the skipped
item were not there: two sessions that differ only in it share the
block's hash, and a session preempted after its first chunk of the new
input resumes from the other session's KV, computed from the other image,
with no error (PR vllm#51694, open, for the output case; 0.31.0 starts at
the first item that reaches the block). The fake model runs no encoder
and its content tags are token ids, so the checks are the hashes against
the request's hashes computed afresh, and where the preempted session
resumes.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig
from harness.offload_checks import computed_tokens_scheduled, fresh_block_hashes

BS = 16
IMAGE = 9  # the placeholder token id every image's positions carry
TEXT = list(range(100, 100 + BS))
# A session's second chunk: two images of a block each, then four tokens.
CHUNK = [IMAGE] * (2 * BS) + list(range(200, 204))


def images(first: str) -> list[tuple[str, int, int]]:
    """The chunk's items: `first`, then the same second image."""
    return [(first, 0, BS), ("second", BS, BS)]


def first_chunk(e: Engine, req_id: str) -> None:
    """Session `req_id` computes TEXT and samples a token, then waits."""
    e.add_request(TEXT, 1, req_id, resumable=True)
    e.step_until_waiting_for_input(req_id)


def second_chunk(e: Engine, req_id: str, first_image: str) -> None:
    """Session `req_id` gets CHUNK, `first_image` its first image."""
    e.add_request(CHUNK, 1, req_id, resumable=True, mm=images(first_image))


def test_a_sessions_next_chunk_hashes_every_image_it_brings():
    e = Engine(HarnessConfig(block_size=BS, offload=False))
    first_chunk(e, "S")
    second_chunk(e, "S", "first")
    session = e.scheduler.requests["S"]
    assert session.block_hashes == fresh_block_hashes(e, session)
    e.run()
    assert session.block_hashes == fresh_block_hashes(e, session)


@pytest.mark.parametrize(
    "items",
    [
        [("a", 33, 2), ("b", 36, 3)],
        [("a", 30, 5), ("b", 36, 3)],
        [("a", 30, 3), ("b", 36, 3)],
    ],
    ids=["two-in-the-block", "one-from-the-block-before", "one-token-into-the-block"],
)
def test_a_block_its_output_completes_hashes_every_image_in_it(items):
    """A 40-token prompt whose partial last block holds two small images,
    or one of its own and one that starts in the block before (running
    into it by three tokens, or by one): the eighth output token completes
    it."""
    e = Engine(HarnessConfig(block_size=BS, offload=False))
    req_id = e.add_request([IMAGE] * 40, max_tokens=10, mm=items)
    e.run()
    request = e.requests[req_id]
    assert len(request.block_hashes) == 3, "the output completed the block"
    assert request.block_hashes == fresh_block_hashes(e, request)


def test_a_preempted_session_resumes_from_no_other_sessions_image():
    """Session A ran its chunk with image "x" first and waits for more,
    holding its blocks. Session B, the same tokens with image "y" first,
    computes its chunk's first block, then a decoding request's next block
    takes the last free one and B is preempted. B resumes from the prefix
    cache: its own first two blocks (32 tokens). Up to 0.30.0 its third
    block's hash is A's (the first image in neither), so it resumes at 48,
    reading A's KV, which attended to "x"."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=10,
            offload=False,
            max_num_batched_tokens=BS + 1,
            reserve_full_isl=False,
        )
    )
    first_chunk(e, "A")
    second_chunk(e, "A", "x")
    e.run()
    e.add_request(list(range(400, 400 + BS)), max_tokens=60, req_id="R")
    decoding = e.scheduler.requests["R"]
    first_chunk(e, "B")
    b = e.scheduler.requests["B"]
    # B's chunk comes when R's next step needs no new block and the step
    # after it does.
    for _ in range(BS):
        if decoding.num_computed_tokens % BS == BS - 1:
            break
        e.step()
    assert decoding.num_computed_tokens % BS == BS - 1, "R decodes a token a step"
    second_chunk(e, "B", "y")
    e.step()
    assert b.num_computed_tokens == 2 * BS, "B computed its chunk's first block"
    e.step()
    assert b.status.name == "PREEMPTED", "R's next block preempted B"
    assert resume_point(e, "B") == 2 * BS
    e.run()
    assert e.runner.violations == []


def resume_point(e: Engine, req_id: str, max_steps: int = 100) -> int:
    """The computed tokens `req_id` is next scheduled with: where a
    preempted request resumes (its prefix hits)."""
    for _ in range(max_steps):
        so = e.step()
        if so is not None and so.num_scheduled_tokens.get(req_id):
            return computed_tokens_scheduled(so)[req_id]
    raise AssertionError(f"{req_id} was not scheduled in {max_steps} steps")
