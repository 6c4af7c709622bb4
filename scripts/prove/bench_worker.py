"""Benchmarks run by scripts/prove/bench.py inside one vLLM tree.

Not for direct use: bench.py starts one worker per tree (base and series,
each with its tree and the project's tests/ on PYTHONPATH) and sends
commands on stdin, one a line; the worker answers each with a line
"BENCH " + JSON (other lines on stdout, such as vLLM's log, are not
answers). The workers stay up, so the two trees are measured in the same
rounds (at once, or with --serial in alternation). Times are the worker's
CPU time (time.process_time), so other load on a shared machine does not
count while the worker waits for a core.

  NAME                          an allocator micro-benchmark (BENCHMARKS):
                                {"name", "seconds"}
  scale prepare ROW SIZE SEED   the scheduler at scale (tests/harness/scale.py):
                                build ROW's engine for bursts of SIZE
                                requests, not timed: {"set_up_seconds"}
  scale bytecodes               one burst through that engine, drained, with
                                the scheduler's Python bytecodes counted
                                (harness.scale.Bytecodes): {"bytecodes", "steps"}
  scale run WINDOW DRAIN LIMIT BURSTS
                                BURSTS bursts through that engine: the
                                scheduler's CPU per step for WINDOW steps of
                                each, and to drain if DRAIN is 1, within
                                LIMIT CPU seconds (harness.scale.Bench.run)
  list                          {"allocator": names, "scheduler": {row: what}}
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

# The harness's spelling of each release's KVCacheManager (tests/ is on
# PYTHONPATH: bench.py puts it there).
from harness.kv_manager import computed_blocks, make_kv_cache_manager

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
        manager = make_kv_cache_manager(
            kv_config(hybrid),
            max_model_len=8192,
            block_size=BLOCK_SIZE,
            max_tokens_per_step=CHUNK,
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
            hits, num_hit = computed_blocks(manager, req)
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


class Scale:
    """The scheduler-at-scale commands: what `prepare` built waits for the
    next `run`, so that bench.py can set up both trees' engines at once and
    time them one after the other."""

    def __init__(self) -> None:
        # Imported on first use: the allocator benchmarks need no engine.
        from harness import scale

        self.scale = scale
        self.bench = None

    def rows(self) -> dict[str, str]:
        return {name: row.what for name, row in self.scale.ROWS.items()}

    def command(self, words: list[str]) -> dict:
        if words[0] == "prepare":
            row, size, seed = words[1], int(words[2]), int(words[3])
            self.bench = None  # the last round's, before building the next
            start = time.perf_counter()
            self.bench = self.scale.Bench(row, size, seed)
            return {"set_up_seconds": time.perf_counter() - start}
        if words[0] == "bytecodes" and self.bench is not None:
            bench, self.bench = self.bench, None
            return bench.count_bytecodes()
        if words[0] == "run" and self.bench is not None:
            window, drain, limit = int(words[1]), words[2] == "1", float(words[3])
            bench, self.bench = self.bench, None
            return bench.run(window, drain, limit, int(words[4]))
        raise ValueError(f"unknown scale command {words}")


def main() -> None:
    # Nothing to choose: --help says how bench.py drives it.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    scale: Scale | None = None
    for line in sys.stdin:
        words = line.split()
        if words == ["list"]:
            scale = scale or Scale()
            listing = {"allocator": list(BENCHMARKS), "scheduler": scale.rows()}
            print(ANSWER + json.dumps(listing), flush=True)
            continue
        if words[:1] == ["scale"]:
            scale = scale or Scale()
            print(ANSWER + json.dumps(scale.command(words[1:])), flush=True)
            continue
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
