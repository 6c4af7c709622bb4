"""Stepping the harness as EngineCore's busy loop does: only while the
scheduler says it has requests, so an engine can go idle with work left
(tests/reproducers/test_offload_idle_store.py, test_offload_lazy_idle.py,
tests/harness_tests/test_upstream_reports.py)."""

from __future__ import annotations

import queue
from typing import Any

from harness.engine import Engine, HarnessConfig


def offload_engine(store_delay: int, **overrides) -> Engine:
    """SimpleCPUOffload on the harness, 32 GPU and 32 CPU blocks unless
    overridden, each store in flight for `store_delay` steps after its
    launch (loads complete in their step)."""
    overrides.setdefault("num_gpu_blocks", 32)
    overrides.setdefault("num_cpu_blocks", 32)
    return Engine(
        HarnessConfig(
            transfer_delay=lambda is_store: store_delay if is_store else 0,
            **overrides,
        )
    )


def lazy_engine(
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    store_delay: int,
    prompts: int,
    streaming: bool = False,
) -> Engine:
    """`prompts` 40-token prompts with two output tokens each; with
    `streaming`, the last one is a streaming session that then waits for
    its next input."""
    e = offload_engine(
        store_delay,
        lazy=True,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_batched_tokens=32,
    )
    for i in range(prompts):
        e.add_request(
            list(range(100 + 40 * i, 140 + 40 * i)),
            max_tokens=2,
            req_id=f"r{i}",
            resumable=streaming and i == prompts - 1,
        )
    return e


def step_as_engine_core(e: Engine, max_steps: int = 1_000) -> int:
    """Step only while the scheduler says it has requests (or a step of the
    batch queue is still out), as EngineCore's busy loop does before it
    blocks on its input queue. Returns the steps taken; raises where the
    engine is still stepping after `max_steps`."""
    for steps in range(max_steps):
        if not (e.scheduler.has_requests() or e.in_flight):
            return steps
        e.step()
    raise AssertionError(f"still stepping after {max_steps} steps")


def held_gpu_blocks(e: Engine) -> int:
    """GPU blocks not in the free queue (the null block aside): held by a
    request or by a transfer in flight."""
    return e.cfg.num_gpu_blocks - 1 - e.block_pool.get_num_free_blocks()


def engine_core_proc(e: Engine) -> Any:
    """vLLM's EngineCoreProc around the harness's engine, for its own
    `_process_engine_step` (a step, its outputs queued, and the busy loop's
    yield after a step that ran no forward): built without `__init__`,
    which starts a model executor and sockets; its step is the harness's
    step, and its post-step hook (draft tokens of a synchronous spec-decode
    step) does nothing. Imported here: the engine core module pulls in the
    executor and messaging stack, which the other helpers do not need."""
    from vllm.v1.engine.core import EngineCoreProc

    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.scheduler = e.scheduler
    proc.output_queue = queue.Queue()

    def step_fn() -> tuple[dict, bool]:
        so = e.step()
        return {}, so is not None and so.total_num_scheduled_tokens > 0

    proc.step_fn = step_fn
    proc.post_step = lambda model_executed: None
    return proc
