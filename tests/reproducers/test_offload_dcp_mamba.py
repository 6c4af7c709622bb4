"""Reproducer for SimpleCPUOffload under decode context parallelism on a
Mamba hybrid (ledger row offload-dcp-hybrid-geometry).

With DCP the full-attention group's KV is striped over the ranks: its
manager's block holds dcp times the spec's tokens. From 0.29.0 the core
runs a full-attention + Mamba hybrid under DCP and keeps the Mamba
group's block at the spec's size (Mamba state is replicated, not
striped). 0.29.0's connector still scaled every group's block by the DCP
size, so it read the Mamba group in blocks twice too large:

- its stores scanned only the first half of the Mamba blocks a request
  had computed, where align mode keeps no state once a prompt is past
  them: a prompt prefilled in one chunk leaves no state on the CPU, and
  no later request ever hits it there;
- a state a chunk boundary did leave there was loaded into the wrong
  block: the request's Mamba state block kept whatever it held before,
  and the request went on from it (silent corruption);
- with a Mamba block as large as attention's, a hit's external tokens
  are not a multiple of the doubled block: EngineCore died on
  `num_external_tokens=32 not aligned to group 1 block_size=64`.

The fix reads each group's block size from the managers, as 0.30.0's
connector does. Releases whose core refuses a Mamba hybrid under DCP
(up to 0.28.0) skip; 0.30.0 on pass bare.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.engine import Engine
from harness.mamba import mamba_engine, prompt_on_the_cpu_only
from harness.offload_checks import loaded_blocks, lost_or_wrong_cpu_blocks

DCP = 2
# Three blocks of full attention under DCP 2 (32 tokens each).
PROMPT = list(range(100, 196))
MORE = list(range(500, 520))


def dcp_mamba_engine(**overrides: Any) -> Engine:
    """A full-attention + Mamba align hybrid with SimpleCPUOffload under
    decode context parallelism, or a skip where the release's core refuses
    one."""
    cfg = dict(num_gpu_blocks=48, num_cpu_blocks=64, decode_context_parallel_size=DCP)
    try:
        return mamba_engine("align", **(cfg | overrides))
    except (AssertionError, ValueError) as error:
        message = str(error)
        if "DCP not support" in message or "support context parallelism" in message:
            pytest.skip(f"this release runs no Mamba hybrid under DCP: {message}")
        raise


def serve_from_the_cpu(e: Engine, max_tokens: int) -> tuple[str, set[int]]:
    """`PROMPT` computed with `max_tokens` tokens past it (stored to the
    CPU) and dropped from the GPU prefix cache; then a request that extends
    it, run to the end. Returns its id and the GPU blocks the connector
    loaded into."""
    prompt_on_the_cpu_only(e, PROMPT, max_tokens)
    assert not lost_or_wrong_cpu_blocks(e, list(e.requests))
    req_id = e.add_request(PROMPT + MORE, max_tokens=3)
    return req_id, loaded_blocks(e)


# How the prompt's request ends: one token past the prompt, so that it
# finishes with its computed tokens on a block boundary, where this series'
# flush of a finished request stores its last blocks (the Mamba state
# among them, whatever the store scan did); or decoding on past it.
ENDINGS = pytest.mark.parametrize(
    "max_tokens", [1, 3], ids=["finished-on-a-boundary", "decoded-past-it"]
)


@ENDINGS
@pytest.mark.parametrize("mamba_block_multiple", [1, 2], ids=["mamba16", "mamba32"])
def test_a_cpu_hit_under_dcp_loads_the_mamba_state(mamba_block_multiple, max_tokens):
    """Prefilled in 32-token chunks, the prompt leaves its attention and a
    Mamba state on the CPU. The next request loads the three attention
    blocks and the state at the hit's end, and reads the state it loaded.
    The connector that scaled the Mamba group by the DCP size loaded no
    state, and the request read a stale block (mamba16), or EngineCore
    died on the alignment assert (mamba32)."""
    e = dcp_mamba_engine(
        max_num_batched_tokens=32, mamba_block_multiple=mamba_block_multiple
    )
    req_id, loaded = serve_from_the_cpu(e, max_tokens)
    assert not e.runner.violations, e.runner.violations[:3]
    assert len(loaded) == 4, f"loaded {sorted(loaded)}: 3 attention + 1 state"
    assert req_id in e.stats.finished


@ENDINGS
def test_a_prompt_prefilled_in_one_chunk_is_served_from_the_cpu(max_tokens):
    """Prefilled in one step, the prompt's Mamba state is in its last
    block, past the half of the blocks the scaled store scan read: the
    release kept no state on the CPU and the next request missed it
    entirely; where a flush stored it, the request read a stale block."""
    e = dcp_mamba_engine(max_num_batched_tokens=128)
    req_id, loaded = serve_from_the_cpu(e, max_tokens)
    assert not e.runner.violations, e.runner.violations[:3]
    assert len(loaded) == 4, f"loaded {sorted(loaded)}: 3 attention + 1 state"
    assert req_id in e.stats.finished
