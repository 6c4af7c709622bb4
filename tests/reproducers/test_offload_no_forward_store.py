"""Reproducer for a store planned in a step without a forward (ledger row
offload-no-forward-store-lost).

A step that schedules no token runs no forward: the GPU runner's
kv_connector_no_forward binds the connector's metadata and asks for the
finished transfers, but up to 0.30.0 it skips wait_for_save(), and from
0.29.0 SimpleCPUOffload's worker launches its stores there. A store
planned for such a step (a finished request's last blocks, stored in the
step after it finished, which is empty when no other request runs) is
never launched. Its event stays pending until a later store's completes:
the worker's high-water mark then passes it and reports it complete, and
the scheduler caches CPU blocks that were never written. A later request
with that prefix loads them: silent KV corruption (vllm PR #56621, first
in 0.31.0).
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.offload_checks import lost_or_wrong_cpu_blocks

FIRST = list(range(100, 148))  # three blocks of 16
SECOND = list(range(500, 548))


def unwritten_cpu_blocks(e: Engine, empty_steps: int) -> list[str]:
    """A first request, prefilled one block a step, finishes in the step
    that computes its last block; `empty_steps` steps that schedule nothing
    follow. A later request's stores then complete and move the worker's
    high-water mark past any store those steps planned. The CPU blocks
    cached with content no store wrote."""
    first = e.add_request(FIRST, max_tokens=1)
    while first not in e.stats.finished:
        e.step()
    for _ in range(empty_steps):
        e.step()
    second = e.add_request(SECOND, max_tokens=4)
    e.run(max_steps=300)
    return [p for p in lost_or_wrong_cpu_blocks(e, [first, second]) if "wrong" in p]


def test_a_store_planned_in_a_step_without_a_forward_reaches_the_cpu():
    """The series' store of a finished request's last blocks (0004) is
    planned in the step after the request finished, empty here."""
    e = Engine(
        HarnessConfig(num_gpu_blocks=32, num_cpu_blocks=32, max_num_batched_tokens=16)
    )
    assert unwritten_cpu_blocks(e, empty_steps=1) == []


def test_a_lazy_store_planned_in_a_step_without_a_forward_completes():
    """Lazy mode's scan plans stores in every step, one that schedules
    nothing too (after the last request finished): on bare 0.29.0 they are
    never launched, so they never complete, and their GPU blocks stay held
    until a later store's completion reports them done, unwritten."""
    e = Engine(
        HarnessConfig(
            num_gpu_blocks=12, num_cpu_blocks=64, lazy=True, max_num_batched_tokens=16
        )
    )
    assert unwritten_cpu_blocks(e, empty_steps=2) == []
