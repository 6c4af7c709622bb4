"""Run differential-oracle traces against whichever vLLM tree is on PYTHONPATH.

    python -m harness.trace_worker --seed N      # one trace, JSON on stdout
    python -m harness.trace_worker --serve       # a seed per stdin line

For each step it records what a client or the worker could tell apart:
which requests were scheduled and for how many tokens, which were
preempted and finished, the free GPU blocks, how many requests wait and
how many of them wait for KV from the connector, and the blocks the
connector loaded and stored. A crash (with where in vLLM it was raised)
and the first invariant violation (of the block pool, or of the scheduler's
queues: harness.queue_state) end the record. scripts/prove/differential.py
compares the records of the base and the series step by step. Any two
accesses of a KV block that nothing orders (harness.fake_cuda's checker)
are counted, with the first named.

At the end it records which requests completed (finished or aborted) and
whether the engine stalled: after the trace's last event, STALL_STEPS steps
in a row that schedule nothing and move no KV while requests remain, or
MAX_STEPS steps in all. The liveness oracle compares those.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

from vllm.v1.request import RequestStatus

from harness.end_state import end_state_violations
from harness.engine import Engine, HarnessConfig
from harness.invariants import manager_violations
from harness.queue_state import is_known_upstream
from harness.soak_worker import where
from harness.traces import FAMILIES, Event, Trace
from harness.workloads import late_transfers

MAX_STEPS = 3000
# Steps in a row with nothing scheduled and no KV moved, after the last
# event, that make a stall: transfers complete within a few steps, so such
# an engine never moves again.
STALL_STEPS = 50


def engine_for(trace: Trace) -> Engine:
    cfg = dict(trace.cfg)
    most = cfg.pop("max_transfer_delay")
    delays = late_transfers(random.Random(trace.seed), most)
    e = Engine(HarnessConfig(**cfg, transfer_delay=delays))
    # A queue violation is recorded like the pool's, not raised as a crash.
    e.raise_queue_violations = False
    return e


def deliver(e: Engine, event: Event) -> None:
    kind, req_id = event[0], event[1]
    known = e.scheduler.requests.get(req_id)
    if kind == "add":
        _, _, prompt, max_tokens, priority, resumable = event
        e.add_request(
            prompt, max_tokens, req_id, resumable=resumable, priority=priority
        )
    elif kind == "chunk" and known is not None and known.resumable:
        _, _, tokens, max_tokens = event
        e.add_request(tokens, max_tokens, req_id, resumable=True)
    elif kind == "end" and known is not None and known.resumable:
        # A request that is not resumable, sent to a session, ends it.
        e.add_request([0], 1, req_id)
    elif kind == "abort" and known is not None:
        e.abort(req_id)


def reset_prefix_cache(e: Engine, steps: list[dict[str, Any]]) -> None:
    """Run until idle (recording each step), then empty the GPU prefix
    cache: the CPU keeps what was offloaded."""
    while e.busy() and len(steps) < MAX_STEPS:
        before = len(e.copy_backend.launched) if e.copy_backend else 0
        steps.append(record(e, e.step(), before))
    e.block_pool.reset_prefix_cache()


def record(e: Engine, so: Any, launched_before: int) -> dict[str, Any]:
    """One step; `so` is None for an async step that only processed the
    output of a step in flight."""
    launched = e.copy_backend.launched[launched_before:] if e.copy_backend else []
    running, waiting = e.scheduler.get_request_counts()
    return {
        "sched": sorted(so.num_scheduled_tokens.items()) if so else [],
        "preempted": sorted(so.preempted_req_ids or ()) if so else [],
        "finished": sorted(so.finished_req_ids) if so else [],
        "free": e.block_pool.get_num_free_blocks(),
        "running": running,
        "waiting": waiting,
        "remote_waiting": sum(
            r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            for r in e.scheduler.requests.values()
        ),
        "loads": sum(len(x["pairs"]) for x in launched if not x["is_store"]),
        "stores": sum(len(x["pairs"]) for x in launched if x["is_store"]),
    }


def run(seed: int, family: str = "mixed") -> dict[str, Any]:
    trace = FAMILIES[family](seed)
    out: dict[str, Any] = {
        "seed": seed,
        "steps": [],
        "crash": None,
        "violation": None,
        "completed": [],
        "stalled": False,
        # The first pair of accesses to a block that nothing orders (the
        # fake CUDA's checker), and how many there were.
        "race": None,
        "races": 0,
        # The first queue violation of the release's own in-place session
        # key change (harness.queue_state.KNOWN_SESSION_KEY): recorded, and
        # the trace goes on, as it does on the base.
        "known_queue": None,
    }
    steps = out["steps"]
    e = None
    try:
        e = engine_for(trace)
        last = trace.last_step()
        idle = 0
        for step in range(MAX_STEPS):
            for event in trace.events.get(step, ()):
                if event[0] == "reset":
                    reset_prefix_cache(e, steps)
                else:
                    deliver(e, event)
            if step > last and not e.busy():
                break
            before = len(e.copy_backend.launched) if e.copy_backend else 0
            so = e.step()
            steps.append(record(e, so, before))
            moved = steps[-1]["sched"] or steps[-1]["loads"] or steps[-1]["stores"]
            idle = 0 if moved or step <= last else idle + 1
            if idle >= STALL_STEPS:
                break
            if problems := manager_violations(e.scheduler.kv_cache_manager):
                out["violation"] = f"step {step}: {problems[0]}"
                break
            if new := [q for q in e.queue_violations if not is_known_upstream(q)]:
                out["violation"] = f"queue: {new[0]}"
                break
            if out["known_queue"] is None and e.queue_violations:
                out["known_queue"] = e.queue_violations[0]
            if e.runner.violations:
                out["violation"] = f"content: {e.runner.violations[0]}"
                break
        # Drained: every block back, no request state left behind.
        drained = not out["violation"] and not e.busy() and not e.scheduler.requests
        if drained and (problems := end_state_violations(e)):
            out["violation"] = f"end: {problems[0]}"
    except Exception as exc:
        if where(exc) == "?":
            raise  # the harness's own failure, not vLLM's: stop the worker
        out["crash"] = f"{type(exc).__name__} at {where(exc)}: {str(exc)[:300]}"
    if e is not None:
        out["completed"] = sorted(e.stats.finished | e.stats.aborted)
        out["stalled"] = not (out["crash"] or out["violation"]) and e.busy()
        out["races"] = len(e.cuda.races)
        out["race"] = str(e.cuda.races[0]) if e.cuda.races else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, help="run this trace and print its record")
    p.add_argument(
        "--serve", action="store_true", help="one 'SEED [FAMILY]' per stdin line"
    )
    p.add_argument(
        "--family", choices=sorted(FAMILIES), default="mixed", help="trace family"
    )
    args = p.parse_args()
    if args.serve:
        for line in sys.stdin:
            seed, *family = line.split()
            print(json.dumps(run(int(seed), *family)), flush=True)
    elif args.seed is not None:
        print(json.dumps(run(args.seed, args.family), indent=1))
    else:
        p.error("give --seed N or --serve")


if __name__ == "__main__":
    main()
