"""Allocator micro-benchmarks, run by scripts/prove/bench.py inside one vLLM tree.

Not for direct use: bench.py starts one worker per tree (base and series,
each with its tree on PYTHONPATH) and sends benchmark names on stdin, one a
line; the worker answers each with a line "BENCH " + JSON {"name",
"seconds"} (other lines on stdout, such as vLLM's log, are not answers). The
workers stay up, so the two trees are measured in alternation. Times are the
worker's CPU time (time.process_time), so other load on a shared machine
does not count while the worker waits for a core.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

ANSWER = "BENCH "
BLOCK_SIZE = 16
POOL_BLOCKS = 8192
POOL_CYCLE_BLOCKS = 20_000  # blocks taken and freed per pool benchmark run
NUM_REQUESTS = 300
PROMPT_TOKENS = 320
SHARED_PREFIX = 128  # tokens all prompts share: prefix hits on the way
CHUNK = 128  # prefill chunk; the rest goes one token per step, like decode

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


def pool_cycle(n: int) -> Callable[[], float]:
    """get_new_blocks(n) / free_blocks cycles on a BlockPool."""

    def run() -> float:
        pool = BlockPool(POOL_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
        get, free = pool.get_new_blocks, pool.free_blocks
        start = time.process_time()
        for _ in range(POOL_CYCLE_BLOCKS // n):
            free(get(n))
        return time.process_time() - start

    return run


def kv_config(hybrid: bool) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    groups = [KVCacheGroupSpec(["full"], spec)]
    if hybrid:
        swa = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float16,
            sliding_window=4 * BLOCK_SIZE,
        )
        groups.append(KVCacheGroupSpec(["swa"], swa))
    return KVCacheConfig(
        num_blocks=POOL_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )


def scheduler_path(hybrid: bool) -> Callable[[], float]:
    """What the scheduler asks of a KVCacheManager for NUM_REQUESTS requests:
    prefix lookup, a prefill chunk, single-token steps, then free."""

    def run() -> float:
        manager = KVCacheManager(
            kv_config(hybrid),
            max_model_len=8192,
            hash_block_size=BLOCK_SIZE,
            max_num_batched_tokens=CHUNK,
            enable_caching=True,
        )
        prefix = list(range(SHARED_PREFIX))
        requests = [
            Request(
                f"r{i}",
                prefix + [10_000 + i] * (PROMPT_TOKENS - SHARED_PREFIX),
                SamplingParams(max_tokens=1),
                None,
                block_hasher=HASHER,
            )
            for i in range(NUM_REQUESTS)
        ]
        allocate = manager.allocate_slots
        start = time.process_time()
        for req in requests:
            hits, num_hit = manager.get_computed_blocks(req)
            chunk = min(CHUNK, req.num_tokens - num_hit)
            assert allocate(req, chunk, num_hit, hits) is not None
            req.num_computed_tokens = num_hit + chunk
            while req.num_computed_tokens < req.num_tokens:
                assert allocate(req, 1) is not None
                req.num_computed_tokens += 1
            manager.free(req)
        return time.process_time() - start

    return run


BENCHMARKS: dict[str, Callable[[], float]] = {
    "pool get/free 1 block": pool_cycle(1),
    "pool get/free 16 blocks": pool_cycle(16),
    "pool get/free 256 blocks": pool_cycle(256),
    "allocate_slots/free, full attention": scheduler_path(hybrid=False),
    "allocate_slots/free, full + sliding window": scheduler_path(hybrid=True),
}


def main() -> None:
    if sys.argv[1:] == ["--list"]:
        print(ANSWER + json.dumps(list(BENCHMARKS)), flush=True)
        return
    for line in sys.stdin:
        name = line.strip()
        gc.collect()
        gc.disable()
        try:
            seconds = BENCHMARKS[name]()
        finally:
            gc.enable()
        print(ANSWER + json.dumps({"name": name, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
