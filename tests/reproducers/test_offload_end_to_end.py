"""End-to-end runs of the offload patches through the real scheduler.

A mixed workload (shared prefixes, prompts ending on block boundaries,
chunked prefills, GPU pressure with preemption and CPU loads, aborts) runs
in eager and in lazy mode. The fake copy engine carries every block's
content tag, so the checks are by value: the runner finds no block with
the wrong content, every block a finished request computed is on the CPU
with its own content (eager, where every block is stored), every store
was ordered after compute, and both pools end with every ref given back.

Eager fails on the base because a request's last block is lost when it is
computed in the step the request finishes in (patch 0004); lazy fails on
the base because its stores are not ordered after compute (patch 0005).
"""

from __future__ import annotations

import random

import pytest

from harness.engine import Engine, HarnessConfig
from harness.invariants import assert_pool_ok
from harness.offload_checks import lost_or_wrong_cpu_blocks, unordered_transfers

BS = 16


def workload(seed: int) -> dict[int, list[tuple[list[int], int]]]:
    """Step -> requests (prompt, max_tokens) to add at that step."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(10, 30000) for _ in range(rng.choice([2, 3, 5]) * BS)]
        for _ in range(4)
    ]
    plan: dict[int, list[tuple[list[int], int]]] = {}
    for _ in range(36):
        prefix = rng.choice(prefixes)
        cut = rng.choice([len(prefix), len(prefix) // BS // 2 * BS, len(prefix)])
        tail = [rng.randrange(10, 30000) for _ in range(rng.choice([0, 1, 9, BS]))]
        prompt = prefix[:cut] + tail or [5]
        # Some end exactly on a block boundary with their last token.
        max_tokens = rng.choice([1, 2, BS - len(prompt) % BS + 1, 40])
        plan.setdefault(rng.randrange(0, 60), []).append((prompt, max_tokens))
    return plan


def run_workload(lazy: bool, hybrid: bool, seed: int = 0) -> tuple[Engine, set[str]]:
    cfg = HarnessConfig(
        block_size=BS,
        num_gpu_blocks=20,
        num_cpu_blocks=1024,
        hybrid=hybrid,
        sliding_window=3 * BS,
        lazy=lazy,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        transfer_delay=lambda is_store: 2 if is_store else 1,
    )
    e = Engine(cfg)
    plan = workload(seed)
    rng = random.Random(seed + 1)
    aborted: set[str] = set()

    def feed(e: Engine) -> None:
        for prompt, max_tokens in plan.pop(e.stats.steps, []):
            req_id = e.add_request(prompt, max_tokens=max_tokens)
            if rng.random() < 0.1:
                aborted.add(req_id)
        for req_id in sorted(aborted - e.stats.aborted - e.stats.finished):
            if rng.random() < 0.3:
                e.abort(req_id)

    feed(e)
    while plan or e.busy():
        e.step()
        feed(e)
        assert e.stats.steps < 5000, "the run does not end"
    return e, e.stats.aborted


def assert_run_ok(e: Engine, aborted: set[str]) -> None:
    assert e.stats.finished | aborted == set(e.requests)
    assert e.runner.violations == [], "\n".join(map(str, e.runner.violations[:5]))
    assert_pool_ok(e.block_pool, all_done=True, label="GPU pool")
    assert_pool_ok(
        e.offload.cpu_block_pool,
        all_done=True,
        label="CPU pool",
        hashed_means_cached=False,
    )
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert loads, "the workload should load from the CPU"


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_eager_run_keeps_every_block(hybrid):
    e, aborted = run_workload(lazy=False, hybrid=hybrid)
    assert_run_ok(e, aborted)
    done = sorted(e.stats.finished - aborted)
    assert lost_or_wrong_cpu_blocks(e, done) == []


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_lazy_run_orders_every_store(hybrid):
    e, aborted = run_workload(lazy=True, hybrid=hybrid)
    assert unordered_transfers(e) == []
    assert_run_ok(e, aborted)
