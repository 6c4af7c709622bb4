"""Run one soak workload against whichever vLLM tree is on PYTHONPATH.

    python -m harness.soak_worker --workload NAME --seed N [--runs R] [--scale K]
    python -m harness.soak_worker --serve

Runs seeds N .. N+R-1 in one process (vLLM's import costs more than a run)
and prints a JSON list, one object per run: what happened (steps, requests
completed and aborted, preemptions), what went wrong (a crash with its
exception type and where in vLLM it was raised, invariant violations found
after any step, content-tag mismatches, stores not ordered after compute,
accesses of a KV block that nothing orders,
CPU blocks lost, blocks leaked at the end, requests that never finished) and
how long the scheduler took. Progress goes to stderr. To replay a run of
`make soak`, set PYTHONHASHSEED to the soak's seed, as it does: vLLM
iterates sets of block hashes, whose order follows the hash seed.

--serve reads one run per line on stdin (`WORKLOAD SEED SCALE`, and
`timing` to skip the checks) and answers each with one JSON line.
scripts/prove/soak.py keeps one such process per tree and alternates them run by
run, so the base and the series are timed side by side under the same
machine load.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time
import traceback
from typing import Any

from harness.engine import Engine
from harness.invariants import manager_violations, pool_violations
from harness.offload_checks import lost_or_wrong_cpu_blocks, unordered_transfers
from harness.peer import PeerEngine
from harness.queue_state import is_known_upstream
from harness.workloads import WORKLOADS, Plan

MAX_STEPS = 20_000
DRAIN_STEPS = 2_000


def where(exc: BaseException) -> str:
    """The innermost frame in vLLM's own code (file:line function)."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/vllm/" in f.filename and "/harness/" not in f.filename
    ]
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename[f.filename.rindex("/vllm/") + 1 :]
    return f"{path}:{f.lineno} {f.name}"


class Run:
    def __init__(self, plan: Plan, checks: bool = True):
        self.plan = plan
        self.checks = checks
        # Queue violations are counted with the pool's (check), not raised;
        # a timing run skips them with the rest.
        self.e = Engine(dataclasses.replace(plan.cfg, check_queues=checks))
        self.e.raise_queue_violations = False
        self.queue_seen = 0
        self.peer = PeerEngine(self.e.block_pool) if plan.peer_strikes else None
        self.violation_steps = 0
        self.first_violation: str | None = None
        self.ids: list[str] = []
        self.held_since: int | None = None

    def check(self) -> None:
        problems = manager_violations(self.e.scheduler.kv_cache_manager)
        if self.e.offload is not None:
            problems += [
                f"CPU pool: {p}"
                for p in pool_violations(
                    self.e.offload.cpu_block_pool, hashed_means_cached=False
                )
            ]
        # Those Engine.step found since the last check, but the release's
        # own in-place session key change (as trace_worker leaves it).
        found = self.e.queue_violations[self.queue_seen :]
        problems += [f"queue: {p}" for p in found if not is_known_upstream(p)]
        self.queue_seen = len(self.e.queue_violations)
        if problems:
            self.violation_steps += 1
            if self.first_violation is None:
                self.first_violation = f"step {self.e.stats.steps}: {problems[0]}"

    def events(self, arrivals: list, aborts: dict[int, list[str]]) -> None:
        step = self.e.stats.steps
        while arrivals and arrivals[0].step <= step:
            a = arrivals.pop(0)
            req_id = self.e.add_request(a.prompt, a.max_tokens, stop_at=a.stop_at)
            self.ids.append(req_id)
            if a.abort_at is not None:
                aborts.setdefault(max(a.abort_at, step + 1), []).append(req_id)
        for req_id in aborts.pop(step, []):
            if req_id not in self.e.stats.finished:
                self.e.abort(req_id)
        if self.peer is None:
            return
        if step in self.plan.peer_strikes:
            self.peer.arm()
        # The peer gives its blocks back peer_hold steps after taking them.
        if self.peer.held and self.held_since is None:
            self.held_since = step
        if (
            self.held_since is not None
            and step >= self.held_since + self.plan.peer_hold
        ):
            self.peer.release()
            self.held_since = None

    def step(self) -> None:
        self.e.step()
        if self.checks:
            self.check()

    def go(self) -> dict[str, Any]:
        arrivals = sorted(self.plan.arrivals, key=lambda a: a.step)
        aborts: dict[int, list[str]] = {}
        total = len(arrivals)
        while arrivals or self.e.busy():
            if self.e.stats.steps >= MAX_STEPS:
                break
            self.events(arrivals, aborts)
            self.step()
        if self.peer is not None:
            self.peer.disarm()
            self.peer.release()
        for _ in range(DRAIN_STEPS):  # transfers still in flight
            if not self.e.busy():
                break
            self.step()
        return self.report(total)

    def report(self, total: int) -> dict[str, Any]:
        e = self.e
        done = manager_violations(e.scheduler.kv_cache_manager, all_done=True)
        leaked_gpu = sum(
            1 for b in e.block_pool.blocks if b.ref_cnt > 0 and not b.is_null
        )
        out = {
            "requests": total,
            "completed": len(e.stats.finished - e.stats.aborted),
            "aborted": len(e.stats.aborted),
            "unfinished": total - len(e.stats.finished | e.stats.aborted),
            "leaked_gpu_blocks": leaked_gpu,
            "leak_detail": done[:3],
            "content_violations": len(e.runner.violations),
            "first_content_violation": str(e.runner.violations[0])
            if e.runner.violations
            else None,
            # Accesses of a KV block that nothing orders (harness.fake_cuda).
            "races": len(e.cuda.races),
            "first_race": str(e.cuda.races[0]) if e.cuda.races else None,
        }
        if e.offload is not None:
            cpu = e.offload.cpu_block_pool
            out["leaked_cpu_blocks"] = sum(
                1 for b in cpu.blocks if b.ref_cnt > 0 and not b.is_null
            )
            out["pinned_cpu_hits"] = len(getattr(e.offload, "_pinned_cpu_hits", {}))
            out["unordered_stores"] = sum(
                1 for p in unordered_transfers(e) if p.startswith("store")
            )
            if self.plan.check_cpu_content and self.checks:
                finished = sorted(e.stats.finished - e.stats.aborted)
                out["lost_cpu_blocks"] = len(lost_or_wrong_cpu_blocks(e, finished))
        return out


def run(name: str, seed: int, scale: int, checks: bool = True) -> dict[str, Any]:
    """One seed of a workload; checks=False skips the invariant checks, for
    timing runs."""
    plan = WORKLOADS[name].make(random.Random(f"{name}/{seed}"), scale)
    result: dict[str, Any] = {"workload": name, "seed": seed, "crash": None}
    start = time.perf_counter()
    r = Run(plan, checks)
    # As timeit does: a collection the harness's garbage triggers would
    # otherwise land in whichever scheduler call happens to be running.
    gc.collect()
    gc.disable()
    try:
        result.update(r.go())
    except Exception as exc:  # a crash is a result, reported with its place
        result["crash"] = {
            "type": type(exc).__name__,
            "where": where(exc),
            "message": str(exc).splitlines()[0][:200] if str(exc) else "",
        }
        result["completed"] = len(r.e.stats.finished - r.e.stats.aborted)
        result["requests"] = len(plan.arrivals)
    finally:
        gc.enable()
    result.update(
        {
            "steps": r.e.stats.steps,
            "scheduled_tokens": r.e.stats.scheduled_tokens,
            "preemptions": r.e.stats.preemptions,
            "violation_steps": r.violation_steps,
            "first_violation": r.first_violation,
            "wall_seconds": round(time.perf_counter() - start, 2),
            "scheduler_seconds": r.e.stats.scheduler_seconds,
        }
    )
    return result


def serve() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        name, seed, scale, *flags = line.split()
        result = run(name, int(seed), int(scale), checks="timing" not in flags)
        print(json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS))
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--runs", type=int, default=1, help="seeds to run")
    p.add_argument("--scale", type=int, default=1, help="more requests per run")
    p.add_argument(
        "--serve", action="store_true", help="take runs from stdin, one per line"
    )
    args = p.parse_args()
    if args.serve:
        gc.freeze()  # what is imported by now stays: each run's collect skips it
        serve()
        return
    if args.workload is None:
        p.error("--workload is required (or --serve)")
    results = []
    for i in range(args.runs):
        results.append(run(args.workload, args.seed + i, args.scale))
        print(f"progress {i + 1}/{args.runs}", file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
