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
from harness.offload_checks import fresh_block_hashes

BS = 16
# Far above the tokens the fake runner samples, so the chunk's first token
# never equals the discarded one.
CHUNK = list(range(5000, 5000 + BS + 4))


@pytest.mark.parametrize("layout", ["sync", "async", "hybrid"])
def test_a_session_chunk_never_leaves_a_stale_block_hash(layout: str):
    # Hybrid: full-attention blocks of two hash blocks beside a sliding
    # window group; a prefix hit is then whole full-attention blocks.
    multiple = 2 if layout == "hybrid" else 1
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=32,
            offload=False,
            async_scheduling=layout == "async",
            hybrid=layout == "hybrid",
            full_block_multiple=multiple,
        )
    )
    # One token short of a block: the turn's sampled token completes it.
    prompt = list(range(100, 100 + multiple * BS - 1))
    e.add_request(prompt, max_tokens=1, resumable=True, req_id="S")
    session = e.scheduler.requests["S"]
    while session.num_output_tokens == 0:
        e.step()
    discarded = session.all_token_ids[-1]
    assert session.num_tokens % (multiple * BS) == 0, "the token completes a block"

    e.add_request(CHUNK, max_tokens=1, req_id="S", resumable=True)
    e.run()
    assert session.all_token_ids[len(prompt)] == CHUNK[0], "the token is replaced"

    # The turn as the model saw it, continued: it must not hit the block
    # the session computed with the chunk's first token.
    e.add_request(prompt + [discarded] + list(range(700, 700 + BS)), max_tokens=1)
    e.run()
    assert e.runner.violations == []
    assert session.block_hashes == fresh_block_hashes(e, session)
