"""Reproducers: a block's hash tells a position given as a token id from
one given as an embedding (ledger row prefix-hash-prompt-embeds-mask).

From 0.21.0 a prompt may mix token ids and embeddings (a chat message
with prompt_embeds parts): the request carries the embeddings tensor, one
row per position, and a mask, `prompt_is_token_ids`, that says which
source the model reads at each position. A block's hash takes its token
ids and a digest of its rows of the tensor, not the mask. Two prompts
with the same token ids and the same tensor, one reading a position's
row and the other its token id, then share block hashes, and the prefix
cache (and SimpleCPUOffload's CPU tier, keyed by the same hashes) serves
one the KV the other's inputs computed, with no error (vllm#56655; no
fix merged upstream by 0.33.0). From 0.29.0 the request zeroes the token
id of a position read from the tensor, so a prompt that sends token id 0
there collides; before, the placeholder id the prompt carries does. The
fake model reads neither source, so the check is where the request's
first chunk starts.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from vllm.v1.request import Request

from harness.engine import Engine
from harness.offload_checks import engine_with_cached_prompt, start_of

# Three blocks of 16: the first two read from the tensor in the prompt
# computed first, the third from its token ids.
TOKENS = [0] * 32 + list(range(100, 116))
ROWS = torch.arange(len(TOKENS) * 8, dtype=torch.float32).reshape(len(TOKENS), 8)
COMPUTED = [False] * 32 + [True] * 16
EXTENSION = list(range(900, 917))


@pytest.fixture(autouse=True)
def _mixed_prompts():
    if "prompt_is_token_ids" not in inspect.signature(Request).parameters:
        pytest.skip("this release takes no mixed prompts (from 0.21.0)")


def _computed(on_the_cpu_only: bool, mask: list[bool] = COMPUTED) -> Engine:
    """An engine whose prefix cache holds the prompt read as `mask` says
    (on the CPU tier only where asked)."""
    return engine_with_cached_prompt(TOKENS, on_the_cpu_only, embeds=(ROWS, mask))


def _start(e: Engine, mask: list[bool], rows: torch.Tensor = ROWS) -> int:
    """Where a request of the same token ids and `rows`, read as `mask`
    says and then 17 token ids of its own, starts computing."""
    rows = torch.cat([rows, torch.zeros(len(EXTENSION), rows.shape[1])])
    embeds = (rows, mask + [True] * len(EXTENSION))
    return start_of(e, TOKENS + EXTENSION, embeds=embeds)


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_token_ids_read_no_kv_computed_from_embeddings(tier):
    e = _computed(on_the_cpu_only=tier == "cpu")
    assert _start(e, [True] * len(TOKENS)) == 0


def test_embeddings_read_no_kv_computed_from_token_ids():
    """The first two blocks read the same rows in both prompts: they hit.
    The third reads the tensor here and token ids in the cached prompt:
    0.21.0-0.28.0 hit it too (its placeholder ids are the cached token
    ids), 0.29.0 on do not (they zero a tensor position's id)."""
    e = _computed(on_the_cpu_only=False)
    assert _start(e, [False] * len(TOKENS)) == 32


def test_a_block_that_reads_one_position_from_its_token_id_ends_the_hit():
    """The first block reads the tensor in both prompts and hits; the
    second reads one position from its token id here, the tensor at every
    position in the cached prompt: no later block is read."""
    e = _computed(on_the_cpu_only=False)
    assert _start(e, [False] * 16 + [True] + [False] * 15 + [True] * 16) == 16


def test_as_many_token_ids_in_other_places_read_none_of_the_kv():
    """Both prompts read one position of the first block from its token id,
    each another one: the block is another input."""
    e = _computed(on_the_cpu_only=False, mask=[True] + [False] * 31 + [True] * 16)
    assert _start(e, [False, True] + [False] * 30 + [True] * 16) == 0


def test_a_mixed_block_read_from_other_rows_is_another_input():
    """The second block reads one position from its token id and the rest
    from the tensor, in both prompts; one of those rows differs. Every
    release tells them apart by the rows; the fix must keep them in its
    digest (every release)."""
    mask = [False] * 16 + [True] + [False] * 15 + [True] * 16
    e = _computed(on_the_cpu_only=False, mask=mask)
    other_row = ROWS.clone()
    other_row[20] += 1
    assert _start(e, mask, rows=other_row) == 16


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_a_mixed_prompt_reads_its_own_kv(tier):
    """The same prompt read the same way hits every block (every release)."""
    e = _computed(on_the_cpu_only=tier == "cpu")
    assert _start(e, COMPUTED) == len(TOKENS)
