"""A KV connector that loads synchronously, on the harness engine.

SimpleCPUOffload's loads are async: the scheduler allocates a hit's
external tokens alone, and the request waits for the load. Connectors
that load synchronously (load_kv_async False: a P/D connector that pulls
the prefill's KV before the forward, DecodeBenchConnector) have the
scheduler allocate the external tokens and the first new tokens in one
allocate_slots call and schedule them in the same step; the worker puts
the KV in place before the forward reads it.

`load_prefix_synchronously` gives the engine such a connector for one
prefix: the engine's SimpleCPUOffload connector, whose class is swapped on
the instance for a subclass (so that the scheduler's isinstance checks and
every other call stay the release's), answers a hit on `prefix` from a
remote holder, synchronously; the fake runner then finds the loaded blocks
holding the prefix's content before its forward, as a real load leaves
them. Every other request is SimpleCPUOffload's, as before.

`allocate_with_external_tokens` makes the scheduler's call alone, on a
KVCacheManager with a Mamba align group, at a chosen free count.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from harness.config import sha256
from harness.engine import Engine
from harness.kv_manager import computed_blocks, make_layout_manager


def load_prefix_synchronously(e: Engine, prefix: list[int]) -> dict[str, int]:
    """From now on, a request whose prompt starts with `prefix` and goes on
    past it gets the tokens up to the prefix's end from the connector,
    loaded synchronously. Returns the loads the worker made: request id ->
    the tokens computed once its load is in place."""
    connector = e.scheduler.connector
    assert connector is not None, "the engine has no connector to load with"
    release_class = type(connector)
    # request id -> (tokens computed before the load, after it).
    pending: dict[str, tuple[int, int]] = {}
    # request id -> block ids per group, until the worker fills them.
    to_fill: dict[str, list[list[int]]] = {}
    done: dict[str, int] = {}

    def holds_prefix(request: Any) -> bool:
        prompt = list(request.prompt_token_ids or ())
        return len(prompt) > len(prefix) and prompt[: len(prefix)] == prefix

    class SynchronousRemote(release_class):  # type: ignore[valid-type,misc]
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if not holds_prefix(request) or num_computed_tokens >= len(prefix):
                return super().get_num_new_matched_tokens(request, num_computed_tokens)
            pending[request.request_id] = (num_computed_tokens, len(prefix))
            return len(prefix) - num_computed_tokens, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            if request.request_id in pending and num_external_tokens > 0:
                to_fill[request.request_id] = [
                    list(ids) for ids in blocks.get_block_ids()
                ]
                # SimpleCPUOffload tracks the request for its stores only.
                num_external_tokens = 0
            super().update_state_after_alloc(request, blocks, num_external_tokens)

    connector.__class__ = SynchronousRemote
    runner = e.runner
    prepare = runner.prepare

    def prepare_then_load(so: Any, step: int) -> None:
        """After the zeroing of the step's new blocks, as a real runner
        runs the connector's load after _update_states: the loaded
        blocks get the prefix's content (a Mamba group: the state at the
        prefix's end, in the block of its last token)."""
        prepare(so, step)
        writes: dict[int, Any] = {}
        for req_id in [r for r in to_fill if r in so.num_scheduled_tokens]:
            table = to_fill.pop(req_id)
            first, end = pending.pop(req_id)
            req = e.requests[req_id]
            for group, bs in enumerate(runner.block_sizes):
                if runner.kinds[group] == "mamba":
                    indices = range((end - 1) // bs, (end - 1) // bs + 1)
                else:
                    indices = range(first // bs, (end - 1) // bs + 1)
                for i in indices:
                    tag = runner.oracle.tag(req, group, i, min(bs, end - i * bs))
                    writes[table[group][i]] = tag
            done[req_id] = end
        if writes:
            runner.forward(f"the synchronous loads of step {step}", [], writes)

    runner.prepare = prepare_then_load  # type: ignore[method-assign]
    return done


def allocate_with_external_tokens(
    mamba: str,
    num_before: int,
    num_new: int,
    num_free: int,
    load: str = "sync",
    local_hit: int = 0,
    hit_held: bool = False,
    block_size: int = 16,
    hash_block_size: int | None = None,
) -> tuple[str, int]:
    """A full-attention + Mamba (`mamba`: mamba_align, mamba_align_spec with
    a speculative block, or mamba_align_checkpoint with a prefill
    checkpoint block) manager, asked for a request's `num_new` new tokens
    after `num_before` others, with `num_free` free blocks. `load` says
    what the `num_before` tokens are:

    - sync: external tokens a connector loads synchronously, allocated in
      the same allocate_slots call as the new ones (the scheduler's call);
    - async: external tokens an async load allocated in an earlier call
      (the measured call is the load's resume);
    - computed: tokens an earlier call computed (a running request);
    - admit: external tokens of an async load, whose own call is the
      measured one, asked as the scheduler admits it where the whole
      prompt must fit (scheduler_reserve_full_isl): `num_new` is the rest
      of the prompt.

    `local_hit`: the request's first tokens hit the prefix cache, left
    there by a request that computed them: finished (its blocks free,
    evictable), or still running with `hit_held`. A `hash_block_size`
    below `block_size` lets that hit end inside a block (from 0.33.0, a
    partial hit, which the allocation copies on write).
    Returns the outcome ('refused', 'allocated' or the error the engine
    would die of) and the blocks the measured call took."""
    init_none_hash(sha256)
    manager = make_layout_manager(
        ("full", mamba), 64, block_size, 1024, hash_block_size=hash_block_size
    )
    hasher = get_request_block_hasher(hash_block_size or block_size, sha256)
    pool = manager.block_pool
    all_free = pool.get_num_free_blocks()
    tokens = list(range(local_hit + num_before + num_new))

    def request(req_id: str, prompt: list[int]) -> Request:
        return Request(
            req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher
        )

    if local_hit:
        producer = request("producer", tokens[:local_hit] + [-1])
        assert manager.allocate_slots(producer, local_hit) is not None
        producer.num_computed_tokens = local_hit
        if not hit_held:
            manager.free(producer)
        # A later step: Mamba takes no hit on a block cached in this one.
        manager.new_step_starts()
    req = request("r", tokens)
    hit_blocks, num_hit = computed_blocks(manager, req)
    assert num_hit == local_hit, f"the prefix cache holds {num_hit} of {local_hit}"
    num_external = num_before if load == "sync" else 0
    if load in ("async", "computed"):
        assert not local_hit, "a hit is taken in the request's first call"
        # The load's own call (then its resume), or the call that computed
        # the tokens before.
        first = manager.allocate_slots(
            req,
            0 if load == "async" else num_before,
            num_external_computed_tokens=num_before if load == "async" else 0,
            delay_cache_blocks=load == "async",
        )
        assert first is not None
        req.num_computed_tokens = num_before
    start = pool.get_num_free_blocks()
    pool.get_new_blocks(start - num_free)
    admit = load == "admit"
    try:
        blocks = manager.allocate_slots(
            req,
            0 if admit else num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks if num_hit else None,
            num_external_computed_tokens=num_before if admit else num_external,
            # Passed only for an admission: up to 0.22.1 allocate_slots has
            # no full_sequence_must_fit.
            **(
                {"delay_cache_blocks": True, "full_sequence_must_fit": True}
                if admit
                else {}
            ),
        )
    except Exception as error:  # what the engine would die of
        return f"{type(error).__name__}: {error}", 0
    taken = num_free - pool.get_num_free_blocks()
    if blocks is None:
        # It may free blocks its request no longer needs (remove_skipped_blocks
        # runs before the count, a Mamba group's old state block).
        assert taken <= 0, "a refused allocation takes nothing"
        return "refused", 0
    if hasattr(manager, "take_kv_cache_block_copies"):
        # A partial hit's copy on write holds both of its blocks until the
        # step that runs the copy is done; the scheduler then frees them.
        _, retained = manager.take_kv_cache_block_copies()
        pool.free_blocks(retained)
    manager.free(req)
    if local_hit and hit_held:
        manager.free(producer)
    held_by_the_test = start - num_free
    assert pool.get_num_free_blocks() == all_free - held_by_the_test, (
        "the requests gave back all they held"
    )
    return "allocated", taken
