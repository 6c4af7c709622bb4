"""Reproducer for the patch that drops a streaming session's stale block
hashes: the next chunk must not keep the hash of a block whose last token
it discards.

A streaming-input session (a resumable request) stops when its turn
samples its last token; the next chunk of input discards that token,
which the model never computed, and appends the chunk's tokens in its
place. When the discarded token completed a block, the request already
holds that block's hash, computed with the discarded token in it. Up to
0.31.0 the hash stays: the session's next turn computes the block with
the chunk's first token and caches it under the old hash, and a request
whose prompt does continue with the discarded token hits that block and
attends to KV of a token it does not have. No error; wrong output.
Upstream drops the hashes of the blocks it truncates from 0.32.0.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine, HarnessConfig

BS = 16
# One token short of a block: the turn's sampled token completes it.
PROMPT = list(range(100, 100 + BS - 1))
CHUNK = list(range(300, 300 + BS + 4))


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
def test_a_session_chunk_never_leaves_a_stale_block_hash(offload: bool):
    e = Engine(
        HarnessConfig(
            block_size=BS, num_gpu_blocks=32, num_cpu_blocks=64, offload=offload
        )
    )
    e.add_request(PROMPT, max_tokens=1, resumable=True, req_id="S")
    session = e.scheduler.requests["S"]
    while session.num_output_tokens == 0:
        e.step()
    discarded = session.all_token_ids[-1]
    assert session.num_tokens == BS, "the sampled token completes the block"

    e.add_request(CHUNK, max_tokens=1, req_id="S", resumable=True)
    e.run()
    assert session.all_token_ids[BS - 1] == CHUNK[0], "the token is replaced"

    # The turn as the model saw it, continued: it must not hit the block
    # the session computed with the chunk's first token.
    e.add_request(PROMPT + [discarded] + list(range(700, 700 + BS)), max_tokens=1)
    e.run()
    assert e.runner.violations == []
    hasher = e.block_hasher
    assert session.block_hashes == hasher_hashes(hasher, session)


def hasher_hashes(hasher, request) -> list:
    """The hashes the request's tokens have now, computed afresh."""
    saved = request.block_hashes
    request.block_hashes = []
    try:
        return list(hasher(request))
    finally:
        request.block_hashes = saved
