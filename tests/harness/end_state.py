"""What must hold once an engine has nothing left to do: every block of
every KV cache group back in the pool, no CPU block still referenced, and
no request state left behind in the scheduler, the connector or the
workers.

Checked at the end of every Engine.run() that leaves no request in the
scheduler (harness.engine), so every test and trace that drains its
requests checks it, in whatever layout and mode it built, not only the
tests that thought of it. A leak a patch adds (a block a deferred free
never gives back, a connector map keyed by a finished request) then fails
the first test that drains, whatever that test was written for.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from harness.invariants import MAMBA_ALIGN_STATE, manager_violations

# Scheduler fields that name requests finished in the last step on purpose:
# the next schedule() hands them to the worker and clears them.
OUTBOX = {"finished_req_ids", "finished_req_ids_dict", "prev_step_scheduled_req_ids"}
# Scheduler state kept in classes of its own that iterate over requests:
# the priority queue (a heap inside) and the series' in-flight prefills.
ITERABLE_STATE = {"PriorityRequestQueue", "InflightPrefills"}


def _names(container: Any) -> set[str]:
    """The request ids a container holds, as keys, elements or Requests."""
    if isinstance(container, dict):
        items = list(container.keys())
    elif (
        isinstance(container, (set, frozenset, list, tuple, deque))
        or type(container).__name__ in ITERABLE_STATE
    ):
        items = list(container)
    else:
        return set()
    out = set()
    for item in items:
        if isinstance(item, str):
            out.add(item)
        elif hasattr(item, "request_id"):
            out.add(item.request_id)
    return out


def leftover_request_state(obj: Any, finished: set[str], label: str) -> list[str]:
    """Containers on `obj` that still name a finished request."""
    out = []
    for name, value in vars(obj).items():
        if name in OUTBOX:
            continue
        left = _names(value) & finished
        if left:
            out.append(f"{label}.{name} still names {sorted(left)[:3]}")
    return out


def held_cpu_blocks(offload: Any) -> list[str]:
    """CPU blocks still referenced once every transfer completed and every
    request left: a pin no load or finish released (a lookup that pinned a
    hit for a request that then loads nothing) holds its blocks forever."""
    pool = offload.cpu_block_pool
    held = [b.block_id for b in pool.blocks if b.ref_cnt and b is not pool.null_block]
    if not held:
        return []
    return [f"CPU blocks {held[:5]} still referenced ({len(held)} in all)"]


def end_state_violations(engine: Any) -> list[str]:
    """What is wrong once every request of `engine` is done."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    out = manager_violations(kv, all_done=True)
    for g, manager in enumerate(kv.coordinator.single_type_managers):
        for name in ("req_to_blocks", "num_cached_block", *MAMBA_ALIGN_STATE):
            value = getattr(manager, name, None)
            if name != "cached_blocks_this_step" and isinstance(value, dict) and value:
                out.append(f"group {g}: {name} still holds {sorted(value)[:3]}")
        # Any other per-request map a manager keeps (one a patch adds too).
        out += leftover_request_state(manager, set(engine.requests), f"group {g}")
    finished = set(engine.requests)
    out += leftover_request_state(scheduler, finished, "scheduler")
    offload = engine.offload
    if offload is not None:
        out += leftover_request_state(offload, finished, "connector")
        out += held_cpu_blocks(offload)
    # The workers learn of a finished request from the next step's
    # finished_req_ids: an engine that stops stepping before it tells them
    # leaves that request's state (block table, input batch row) behind.
    told = sorted(set(engine.runner.tables) & finished)
    if told:
        out.append(f"runner still holds the block tables of {told[:3]}")
    return out
