"""Consistency checks of a BlockPool, for tests and the soak (not hot paths).

Each check returns a list of violations (empty when consistent) so a caller
can report all of them at once; `assert_pool_ok` raises on any.
"""

from __future__ import annotations

from typing import Any


def free_list(queue: Any, limit: int) -> tuple[list[Any], str | None]:
    """The blocks linked from the queue's head, and a problem if the walk broke.

    The walk stops after `limit` blocks so that a corrupted (cyclic) list
    cannot hang a test.
    """
    blocks = []
    prev = queue.fake_free_list_head
    node = prev.next_free_block
    while node is not queue.fake_free_list_tail:
        if node is None:
            return blocks, f"free list ends without its tail after {len(blocks)} blocks"
        if node.prev_free_block is not prev:
            return blocks, f"block {node.block_id} has a wrong prev link"
        if len(blocks) >= limit:
            return blocks, f"free list longer than {limit} blocks (a cycle?)"
        blocks.append(node)
        prev, node = node, node.next_free_block
    if queue.fake_free_list_tail.prev_free_block is not prev:
        return blocks, "the fake tail's prev link does not point at the last block"
    return blocks, None


def queue_snapshot(queue: Any, limit: int = 1 << 16) -> dict[str, Any]:
    """Everything a pop could change: count, order and links of the queue."""
    blocks, problem = free_list(queue, limit)
    return {
        "num_free_blocks": queue.num_free_blocks,
        "order": [b.block_id for b in blocks],
        "links": [
            (
                getattr(b.prev_free_block, "block_id", None),
                getattr(b.next_free_block, "block_id", None),
            )
            for b in blocks
        ],
        "problem": problem,
    }


def pool_snapshot(pool: Any) -> dict[str, Any]:
    """Queue state plus every block's ref count and hash, and the cache map."""
    return {
        "queue": queue_snapshot(pool.free_block_queue, pool.num_gpu_blocks + 2),
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "hashes": [b.block_hash for b in pool.blocks],
        "cached": len(pool.cached_block_hash_to_block),
    }


def in_cache_map(pool: Any, block: Any) -> bool:
    entry = pool.cached_block_hash_to_block._cache.get(block.block_hash)
    if isinstance(entry, dict):
        return entry.get(block.block_id) is block
    return entry is block


def pool_violations(
    pool: Any, *, all_done: bool = False, hashed_means_cached: bool = True
) -> list[str]:
    """What is wrong with `pool`; with all_done, also any block still held.

    hashed_means_cached: a block with a hash must be in the prefix cache map
    (true of the GPU pool; the CPU offload pool stamps hashes on blocks whose
    stores are still in flight).
    """
    out = []
    queue = pool.free_block_queue
    blocks, problem = free_list(queue, pool.num_gpu_blocks + 2)
    if problem:
        out.append(problem)
    if len(blocks) != queue.num_free_blocks:
        out.append(
            f"free list holds {len(blocks)} blocks but num_free_blocks is "
            f"{queue.num_free_blocks}"
        )
    in_queue = set()
    for b in blocks:
        if b.block_id in in_queue:
            out.append(f"block {b.block_id} is in the free list twice")
        in_queue.add(b.block_id)
        if b.ref_cnt != 0:
            out.append(f"block {b.block_id} is free but has ref_cnt {b.ref_cnt}")
        if b.is_null:
            out.append("the null block is in the free list")
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt < 0:
            out.append(f"block {b.block_id} has negative ref_cnt {b.ref_cnt}")
        if b.ref_cnt == 0 and b.block_id not in in_queue:
            out.append(f"block {b.block_id} has ref_cnt 0 but is not free (leaked)")
        if all_done and b.ref_cnt != 0:
            out.append(f"block {b.block_id} still held (ref_cnt {b.ref_cnt})")
        if (
            hashed_means_cached
            and b.block_hash is not None
            and not in_cache_map(pool, b)
        ):
            out.append(f"block {b.block_id} has a hash but is not in the cache map")
    return out


def assert_pool_ok(
    pool: Any, *, all_done: bool = False, label: str = "pool", **kw: Any
) -> None:
    problems = pool_violations(pool, all_done=all_done, **kw)
    assert not problems, f"{label} is inconsistent:\n  " + "\n  ".join(problems)


def manager_violations(kv_cache_manager: Any, *, all_done: bool = False) -> list[str]:
    """What is wrong between a KVCacheManager's requests and its pool.

    Every block a request holds is allocated (ref_cnt at least the number of
    requests holding it), belongs to one KV cache group, and appears once in
    the request's list; with all_done, no request is left. Plus the pool's
    own checks.
    """
    pool = kv_cache_manager.block_pool
    out = pool_violations(pool, all_done=all_done)
    holders: dict[int, int] = {}
    group_of: dict[int, int] = {}
    managers = kv_cache_manager.coordinator.single_type_managers
    for g, manager in enumerate(managers):
        for req_id, blocks in manager.req_to_blocks.items():
            seen = set()
            for b in blocks:
                if b.is_null:
                    continue
                if b.block_id in seen:
                    out.append(f"{req_id} holds block {b.block_id} twice in group {g}")
                seen.add(b.block_id)
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
                if group_of.setdefault(b.block_id, g) != g:
                    out.append(
                        f"block {b.block_id} is held in groups "
                        f"{group_of[b.block_id]} and {g}"
                    )
        if all_done and (manager.req_to_blocks or manager.num_cached_block):
            out.append(
                f"group {g} still tracks requests "
                f"{sorted(set(manager.req_to_blocks) | set(manager.num_cached_block))}"
            )
    for block_id, n in sorted(holders.items()):
        ref_cnt = pool.blocks[block_id].ref_cnt
        if ref_cnt < n:
            out.append(f"block {block_id} is held {n} times but has ref_cnt {ref_cnt}")
    return out


def assert_manager_ok(
    kv_cache_manager: Any, *, all_done: bool = False, label: str = "KV cache"
) -> None:
    problems = manager_violations(kv_cache_manager, all_done=all_done)
    assert not problems, f"{label} is inconsistent:\n  " + "\n  ".join(problems)


# Per-request state a Mamba group in "align" mode keeps beside its block
# table (names vary by release; those a release lacks are skipped).
MAMBA_ALIGN_STATE = (
    "last_state_block_idx",
    "_num_retired_blocks",
    "_allocated_block_reqs",
    "_checkpoints",
    "_producer_partial_tail_reqs",
    "cached_blocks_this_step",
    "_pending_boundary_state_offloads",
)


def plain(value: Any) -> Any:
    """A comparable copy: blocks by id, sets sorted, containers copied."""
    if hasattr(value, "block_id") and hasattr(value, "ref_cnt"):
        return ("block", value.block_id)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def manager_snapshot(kv_cache_manager: Any) -> dict[str, Any]:
    """What a refused allocation must leave as it was.

    The free queue's order and the prefix-cache entries of free blocks are
    left out: blocks an allocation popped and gave back return to the tail
    of the queue, and lose the cache entry they were evicted from.
    """
    pool = kv_cache_manager.block_pool
    blocks, _ = free_list(pool.free_block_queue, pool.num_gpu_blocks + 2)
    managers = kv_cache_manager.coordinator.single_type_managers
    return {
        "groups": [
            {
                # An empty entry holds nothing (remove_skipped_blocks makes one).
                "blocks": {
                    r: [b.block_id for b in bs]
                    for r, bs in m.req_to_blocks.items()
                    if bs
                },
                "num_cached_block": dict(m.num_cached_block),
                "new_block_ids": list(m.new_block_ids),
                **{
                    name: plain(getattr(m, name))
                    for name in MAMBA_ALIGN_STATE
                    if hasattr(m, name)
                },
            }
            for m in managers
        ],
        "ref_cnt": [b.ref_cnt for b in pool.blocks if not b.is_null],
        "free": sorted(b.block_id for b in blocks),
        "num_free_blocks": pool.get_num_free_blocks(),
        "held_hashes": [
            (b.block_id, b.block_hash)
            for b in pool.blocks
            if b.ref_cnt > 0 and not b.is_null
        ],
    }
