"""What each patch may change in the differential's step records, and when.

The differential (prove/differential.py) accepts a first divergence
between base and series only where an Effect of a patch the series carries
names every observable that differs, and its condition holds there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Effect:
    """What a patch may change, and when: `patch` is part of its file name,
    `when` a condition on the trace and the steps so far (CONDITIONS)."""

    patch: str
    observables: frozenset[str]
    when: str
    why: str


# The scheduling that follows a different load or store (what is cached,
# what is free, what is admitted) differs too.
AFTER_TRANSFERS = frozenset({"free", "sched", "running", "waiting", "finished"})
EFFECTS = [
    Effect(
        "Pin-SimpleCPUOffload-CPU-hits",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "loads",
        "CPU hits stay pinned from lookup to load: loads the base lost happen",
    ),
    Effect(
        "Store-the-final-blocks",
        AFTER_TRANSFERS | {"stores", "ended"},
        "eager",
        "eager offload: a request that finishes in the step its last block is "
        "computed keeps its blocks until that block is stored",
    ),
    Effect(
        "Order-SimpleCPUOffload-GPU-CPU-stores",
        AFTER_TRANSFERS | {"stores", "loads", "ended"},
        "stores",
        "stores wait for the compute that wrote their blocks",
    ),
    Effect(
        "store-only-blocks-that",
        AFTER_TRANSFERS | {"stores", "loads", "ended"},
        "stores",
        "eager stores skip block ids that no longer hold their position",
    ),
    Effect(
        "keep-the-engine-steppin",
        AFTER_TRANSFERS | {"stores", "loads", "ended"},
        "stores",
        "the engine takes empty steps while a store is queued or in flight "
        "(async scheduling launches one where it only processed the step in "
        "flight): stores complete, and free their blocks, at other steps",
    ),
    Effect(
        "an-idle-lazy-engine",
        AFTER_TRANSFERS | {"stores", "loads", "ended"},
        "lazy-stores",
        "lazy offload: a step that schedules no token and has no load while a "
        "store is in flight starts no store; the next step's scan stores "
        "other blocks, after its own allocation",
    ),
    Effect(
        "a-lazy-engine-s-stores",
        AFTER_TRANSFERS | {"stores", "loads", "ended"},
        "lazy-stores",
        "lazy offload before 0.30.0: the engine takes empty steps while a "
        "store is in flight, and such a step starts no store: stores "
        "complete, and free their blocks, at other steps",
    ),
    Effect(
        "touch-every-group-s-prefix-hits",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted"},
        "hybrid-loads",
        "hybrid requests with CPU hits take every group's prefix hits first",
    ),
    Effect(
        "go-on-to-the-requests-that-hold",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "loads",
        "where the scan stops for blocks, finished async loads waiting behind it go on",
    ),
    Effect(
        "break-a-KV-deadlock",
        frozenset({"free", "preempted"}),
        "idle",
        "with nothing running and the scan stopped for blocks, one waiting "
        "request that holds blocks gives them back, reported as preempted",
    ),
    Effect(
        "Free-a-request-s-KV-blocks-only-after",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "overlapped",
        "under async scheduling, blocks of a request that ends or is preempted "
        "while a step in flight computes it come back a step later",
    ),
    Effect(
        # R5 (0.24.0-0.29.0; upstream from 0.30.0): where frees are deferred
        # (a consuming connector under async scheduling), a preemption would
        # give back no block until the step in flight is processed.
        "do-not-preempt-a-request-whose-blocks",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "overlapped",
        "under async scheduling with a consuming connector, a running request "
        "whose blocks a step in flight still uses is not preempted for blocks "
        "its preemption would only defer",
    ),
    Effect(
        "Drop-sliding-window-blocks-by-the",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "overlapped-window",
        "under async scheduling, sliding-window blocks a step in flight still "
        "writes are dropped a step later",
    ),
    Effect(
        "Streaming-input-drop-the-hashes",
        AFTER_TRANSFERS | {"loads", "stores", "remote_waiting", "preempted", "ended"},
        "session-chunks",
        "a streaming session's next chunk drops the hashes of the blocks it "
        "truncates: where the release hit those stale hashes, the prefix hits "
        "differ, and what is computed, cached and moved after them",
    ),
    Effect(
        "Streaming-input-a-session-preempted",
        AFTER_TRANSFERS | {"loads", "stores", "remote_waiting", "preempted", "ended"},
        "session-chunks",
        "under async scheduling, a session stopped by the output of a step in "
        "flight at its preemption keeps its context for its next chunk, and "
        "stays queued: it computes the tokens the release dropped, or runs "
        "where the release left it in no queue",
    ),
    Effect(
        "a-session-s-stop-drops-the-outp",
        AFTER_TRANSFERS | {"loads", "stores", "remote_waiting", "preempted", "ended"},
        "session-chunks",
        "under async scheduling, a session's stop drops the output of its step "
        "in flight: no token of the ended turn is appended to its next chunk, "
        "and no second stop queues it twice or counts it twice",
    ),
    Effect(
        # R1 (0.19.0-0.19.1; upstream from 0.20.0): the admission gate counts
        # a sliding-window group by the blocks it holds at once.
        "admit-a-request-by-the-sliding-window",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "hybrid",
        "a hybrid's admission counts a sliding-window group by the blocks it "
        "holds at once, not by the whole prompt: a request the release "
        "refused for blocks is admitted",
    ),
    Effect(
        "admit-an-async-KV-load",
        AFTER_TRANSFERS | {"loads", "remote_waiting", "preempted", "ended"},
        "loads",
        "an async KV load waits while in-flight prefills need the blocks",
    ),
]


def condition(name: str, trace: dict[str, Any], base: list, series: list, i: int):
    """Whether `name` holds at step i (records up to i of both trees)."""
    if name == "idle":
        # The base scheduled nothing at step i, with nothing running and
        # requests waiting: the only steps where a deadlock can be broken.
        # Past the base's last step (the series took more) it did nothing.
        if i >= len(base):
            return False
        step = base[i]
        return not step["sched"] and not step["running"] and bool(step["waiting"])
    if name == "session-chunks":
        # A session's next chunk has been sent (the record index is at least
        # the trace step: a reset's run to idle adds records).
        first = trace.get("first_chunk_step")
        return first is not None and i >= first
    if name == "hybrid":
        return trace["hybrid"]
    if not trace["offload"]:
        return False
    if name == "overlapped-window":
        return bool(trace.get("async_scheduling")) and trace["hybrid"]
    if name == "eager":
        return not trace["lazy"]
    if name == "overlapped":
        return bool(trace.get("async_scheduling"))
    seen = [*base[: i + 1], *series[: i + 1]]
    if name == "stores":
        return any(r["stores"] for r in seen)
    if name == "lazy-stores":
        return trace["lazy"] and any(r["stores"] for r in seen)
    loads = any(r["loads"] or r["remote_waiting"] for r in seen)
    if name == "loads":
        return loads
    if name == "hybrid-loads":
        return trace["hybrid"] and loads
    raise ValueError(f"unknown condition {name}")
