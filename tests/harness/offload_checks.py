"""Checks of the CPU offload side of an Engine run, by content tag.

The fake copy engine copies each block's content tag, so what the CPU cache
holds can be compared with what each request computed: a block that never
reached the CPU is lost, one holding another tag is wrong.
"""

from __future__ import annotations

import math
from typing import Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    make_block_hash_with_group_id,
)
from vllm.v1.request import Request

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.runner import ContentOracle


def new_request(
    e: Engine, prompt: list[int], max_tokens: int = 1, req_id: str = "probe"
) -> Request:
    """A request hashed like the engine's, not added to its scheduler."""
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=e.block_hasher,
    )


def assert_cpu_pool_free(e: Engine) -> None:
    """Every CPU block back in the pool (a hash may stay: cached, unheld)."""
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )


def loads_in_flight_engine(load_steps: int = 0, **overrides: Any) -> Engine:
    """SimpleCPUOffload on 64 GPU blocks of 16 tokens and a CPU tier of 256,
    each load taking `load_steps` steps (stores none), a failed load
    recomputed (the "recompute" policy): the set-up of the tests that keep
    async loads in flight while the scheduler admits others. `overrides`:
    HarnessConfig's fields."""
    cfg: dict[str, Any] = dict(
        block_size=16,
        num_gpu_blocks=64,
        num_cpu_blocks=256,
        kv_load_failure_policy="recompute",
        transfer_delay=lambda is_store: 0 if is_store else load_steps,
    )
    return Engine(HarnessConfig(**(cfg | overrides)))


def engine_with_cached_prompt(
    prompt: list[int], on_the_cpu_only: bool, **request: Any
) -> Engine:
    """An engine (32 GPU blocks, a CPU tier of 32) whose prefix cache holds
    `prompt`, computed as `request` says (add_request's keywords), and on
    the CPU tier only where asked: the block-hash identity reproducers'
    scene, where a later request must not read what this one computed."""
    e = Engine(HarnessConfig(num_gpu_blocks=32, num_cpu_blocks=32))
    e.add_request(prompt, max_tokens=3, **request)
    e.run()
    if on_the_cpu_only:
        assert e.block_pool.reset_prefix_cache()
    return e


def start_of(e: Engine, prompt: list[int], **request: Any) -> int:
    """Where a request of `prompt` (as `request` says) starts computing:
    the tokens it read from a cache. It runs to its end, checked."""
    req_id = e.add_request(prompt, max_tokens=2, **request)
    (_, start, _), _ = first_chunk_and_loads(e, req_id)
    assert req_id in e.stats.finished
    return start


def fresh_block_hashes(e: Engine, request: Request) -> list[Any]:
    """The block hashes of the request's tokens now, computed afresh: what
    its hashes, kept up as tokens came, must equal."""
    saved = request.block_hashes
    request.block_hashes = []
    try:
        return list(e.block_hasher(request))
    finally:
        request.block_hashes = saved


def loaded_blocks(e: Engine, max_steps: int = 1_000) -> set[int]:
    """Run `e` until idle; the GPU blocks the connector loaded into."""
    return first_chunk_and_loads(e, None, max_steps)[1]


def first_chunk_and_loads(
    e: Engine, req_id: str | None, max_steps: int = 1_000
) -> tuple[tuple[int, int, int], set[int]]:
    """Run `e` until idle. Returns (step, computed tokens, scheduled tokens)
    of the first step that computes tokens of `req_id` (asserted to come,
    where `req_id` is given), and the GPU blocks the connector loaded
    into."""
    first = (-1, -1, 0)
    loaded: set[int] = set()
    for _ in range(max_steps):
        if not e.busy():
            assert req_id is None or first[0] >= 0, f"{req_id} never computed"
            e.run()  # no step left: the end-of-run checks, as any run ends
            return first, loaded
        step = e.stats.steps
        so = e.step()
        meta = getattr(so, "kv_connector_metadata", None) if so else None
        loaded |= set(getattr(meta, "load_gpu_blocks", ()) or ())
        if first[0] < 0 and so is not None and so.num_scheduled_tokens.get(req_id):
            computed = computed_tokens_scheduled(so)[req_id]
            first = (step, computed, so.num_scheduled_tokens[req_id])
    raise AssertionError(f"still busy after {max_steps} steps")


def computed_tokens_scheduled(so: Any) -> dict[str, int]:
    """Each request a scheduler output schedules: the tokens it had
    computed (for a request new or resumed this step, its prefix hits)."""
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    c = so.scheduled_cached_reqs
    computed.update(zip(c.req_ids, c.num_computed_tokens, strict=True))
    return computed


def group_block_hashes(e: Engine, req: Request, group: int) -> Any:
    """The request's block hashes counted in `group`'s blocks: a group whose
    blocks are larger than the hash block is cached under the hash of all
    the hash blocks each of its blocks covers, as the block pool keys it."""
    size = e.block_sizes[group]
    if size == e.hash_block_size:
        return req.block_hashes
    return BlockHashListWithBlockSize(req.block_hashes, e.hash_block_size, size)


def cpu_block_of(e: Engine, req: Request, index: int, group: int = 0) -> Any:
    """The CPU block caching block `index` of `req` in `group` (counted in
    that group's blocks), or None."""
    hashes = group_block_hashes(e, req, group)
    key = make_block_hash_with_group_id(hashes[index], group)
    return e.offload.cpu_block_pool.cached_block_hash_to_block.get_one_block(key)


def cpu_tag(e: Engine, req: Request, index: int, group: int = 0) -> Any:
    block = cpu_block_of(e, req, index, group)
    return None if block is None else e.kv.cpu.get(block.block_id)


def lost_or_wrong_cpu_blocks(e: Engine, req_ids: list[str]) -> list[str]:
    """Blocks the requests computed that the CPU lacks or holds with the
    wrong content: every full-attention block, and in a hybrid layout the
    sliding-window blocks of the request's last window (those before it
    were dropped on the GPU and need not reach the CPU, but any of them the
    CPU holds must hold the right content). With groups of different block
    sizes, a prefix hit ends on a multiple of every group's block size, so
    a block past the request's last such multiple could never serve one
    (from 0.22.0 the hybrid coordinator does not even cache it): it need
    not reach the CPU either. A Mamba group's blocks need not reach it
    (align mode keeps only some states, at block boundaries), but any the
    CPU holds must hold the state after its block's last token. Needs a CPU
    pool large enough that nothing was evicted from it."""
    sizes = e.block_sizes
    oracle = ContentOracle(sizes)
    hit_unit = math.lcm(*sizes)
    problems = []
    for req_id in req_ids:
        req = e.requests[req_id]
        last_window = max(0, req.num_computed_tokens - e.cfg.sliding_window + 1)
        hittable = req.num_computed_tokens // hit_unit * hit_unit
        kinds = e.cfg.group_kinds()
        for group, (kind, bs) in enumerate(zip(kinds, sizes, strict=True)):
            first = last_window // bs if kind == "swa" else 0
            needed = range(0) if kind == "mamba" else range(first, hittable // bs)
            for i in range(req.num_computed_tokens // bs):
                want = oracle.tag(req, group, i, bs)
                got = cpu_tag(e, req, i, group)
                stored = cpu_block_of(e, req, i, group) is not None
                if got == want or (not stored and i not in needed):
                    continue
                what = "wrong" if stored else "lost"
                problems.append(f"{req_id} group {group} block #{i}: {what} ({got!r})")
    return problems


def unordered_transfers(e: Engine) -> list[str]:
    """Launched copies that break the store barrier's contract, as the copy
    driver saw them: a store must be issued on a stream that waited for an
    event recorded on the compute stream after the last compute write
    before it, and read its source in stream order (STREAM), else the DMA
    may read KV the compute has not written yet; a load reads stable pinned
    host memory and needs neither (no wait, ANY)."""
    problems = []
    for x in e.copy_backend.launched:
        kind = "store" if x["is_store"] else "load"
        if not x["copies"]:
            problems.append(f"{kind} {x['event_idx']}: no copy reached the driver")
        for c in x["copies"]:
            after_compute = any(
                m.stream == "compute" and m.seq > c.last_compute_write for m in c.waited
            )
            got = (after_compute, c.src_access_order)
            want = (True, "STREAM") if x["is_store"] else (False, "ANY")
            if got != want:
                problems.append(
                    f"{kind} {x['event_idx']}: (waits for compute, order) = "
                    f"{got}, want {want}"
                )
    return problems


def load_races(e: Engine) -> list[str]:
    """The fake CUDA's races in which a load takes part (a bare release
    before 0.24.0 also has unordered stores, which patch 0005 fixes)."""
    return [
        str(r)
        for r in e.cuda.races
        if "load" in (r.first.op.stream, r.second.op.stream)
    ]
