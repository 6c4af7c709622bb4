"""Reproducer for patch 0018: with EAGLE/MTP, a Mamba hybrid's prefix hit
never counts an attention block the drafter's drop removed.

With a drafter, the prefix lookup matches each EAGLE group one block past
the candidate length and drops that block again, so that the drafter
recomputes the hidden states of the hit's last block. The drop is made by
the attention groups' lookups; a Mamba group's lookup drops nothing (the
drafter has no Mamba layers). 0.20.0-0.25.1 give every EAGLE group the
margin, the Mamba group too: on a full-attention + Mamba hybrid the
attention group hits three blocks of a cached 64-token prefix (four found,
the last dropped), the Mamba group the state after 64 tokens, and the hit
length follows the Mamba group. The request then starts at token 64 with
three attention blocks: the fourth is allocated, zeroed, never computed,
and read by every step after (vllm-project/vllm#43559's accuracy drop, no
error). From 0.26.0 a Mamba group gets no margin. The harness has no
drafter: the groups are marked EAGLE on the coordinator, as a model with
one has them, and only the prefix lookup's rules run.
"""

from __future__ import annotations

import pytest

from harness.engine import Engine
from harness.mamba import (
    attention_evicted_past_the_mamba_state,
    enable_eagle,
    mamba_engine,
    skip_where_a_load_is_refused,
)

PREFIX = list(range(100, 164))  # four blocks of 16
EXTENSION = list(range(900, 917))


def hit_of(e: Engine, req_id: str) -> int:
    """Run `e` until idle; the tokens `req_id` took from the prefix cache."""
    hit = None
    while e.busy():
        so = e.step()
        for new in so.scheduled_new_reqs if so else ():
            if new.req_id == req_id and hit is None:
                hit = new.num_computed_tokens
    assert hit is not None, f"{req_id} was never scheduled"
    return hit


def extended_prefix_hit(
    e: Engine, cached: bool = True, prompt: list[int] = PREFIX + EXTENSION
) -> int:
    """Cache PREFIX (unless `cached` is False: the test did), then run
    `prompt`: its prefix hit, checked to read no attention KV that was
    never computed."""
    enable_eagle(e)
    if cached:
        e.add_request(PREFIX, max_tokens=3)
        e.run()
    req_id = e.add_request(prompt, max_tokens=2)
    hit = hit_of(e, req_id)
    assert e.runner.violations == [], (
        f"a prefix hit of {hit} tokens read attention KV never computed:\n  "
        + "\n  ".join(str(v) for v in e.runner.violations)
    )
    return hit


@pytest.mark.parametrize(
    "chunk", [128, 16], ids=["prefix-in-one-step", "prefix-block-by-block"]
)
def test_the_hit_stops_at_the_attention_blocks(chunk):
    """`chunk` is the step's token budget: 128 computes the prefix in one
    step (align mode keeps the Mamba state after 64 tokens only), 16 in
    four (the state after each block is kept, so a shorter hit exists)."""
    hit = extended_prefix_hit(
        mamba_engine("align", offload=False, max_num_batched_tokens=chunk)
    )
    if chunk == 16:
        # Still a hit: the attention group's three blocks, where the Mamba
        # group has a state too.
        assert hit == 48


@pytest.mark.parametrize("scene", ["same-prompt-again", "attention-evicted"])
def test_no_hit_reads_an_attention_block_the_drop_removed(scene):
    """Other hits where the Mamba group's state lies past what the attention
    groups keep after the drop (prefix computed block by block): PREFIX sent
    again (the lookup stops a token short of the prompt, so attention keeps
    two or three blocks by release), or PREFIX's attention blocks evicted
    past the second while its Mamba states stay cached. On 0.20.0-0.25.1
    the hit follows the Mamba group past the attention blocks."""
    e = mamba_engine("align", offload=False, max_num_batched_tokens=16)
    if scene == "attention-evicted":
        enable_eagle(e)  # before the prefix is cached, as an EAGLE engine
        attention_evicted_past_the_mamba_state(e, PREFIX, 2)
        extended_prefix_hit(e, cached=False)
    else:
        extended_prefix_hit(e, prompt=PREFIX)


def test_the_hit_stops_at_the_attention_blocks_with_a_connector():
    """The same prefix with the CPU offload connector configured. On
    0.24.0-0.25.1 a connector's local hit comes from the scheduler's
    per-group lookup, not the coordinator's, and there only the patch after
    0018 (R6, "Mamba hybrids with a KV connector: no local hit deeper than
    full attention's") keeps the hit at the attention blocks: 0018 holds
    with a connector only with R6 beneath it (the ledger's row
    eagle-mamba-hit-mismatch). Not a trailer test: it guards the pair."""
    e = mamba_engine("align", max_num_batched_tokens=128)
    with skip_where_a_load_is_refused("align"):
        extended_prefix_hit(e)
