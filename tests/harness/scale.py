"""The scheduler at production scale, for `make bench`: a burst of requests.

Each row is a harness layout (harness.engine: vLLM's real Scheduler and
KVCacheManager, with or without the SimpleCPUOffload connector, on the
fake CUDA) and a burst of `size` requests submitted at once. What is
measured is the scheduler's own CPU time (time.process_time around
`schedule()` and `update_from_output()`) in each engine step, not the
runner's or the offload worker's.

A round builds a fresh engine (`Bench`; not timed: the prefixes stored on
the CPU beforehand), so every round of a cell, on either tree, starts
from the same state. `Bench.run` then submits the burst and times its
first `window` steps (at 4,096 requests and more the scheduler still holds
nearly all of them by then) and, when asked, every step until the last
request finished: the total CPU to drain the burst. Small bursts are
repeated in a round, each starting as the first did.

The rows:
  plain            no connector, plenty of blocks;
  tight            no connector, a pool a fifth of what the running
                   requests want: preemption;
  tight-priority   the same under priority scheduling (priorities 0-7);
  offload-tight    SimpleCPUOffload, prefixes stored on the CPU and dropped
                   from the GPU, a pool half of what the burst wants: async
                   loads (landing two steps late) pile up in flight, then
                   preemption;
  offload-async    the same under async scheduling;
  offload-burst    SimpleCPUOffload, plenty of blocks: every request's
                   prefix is its own, computed once, stored to the CPU and
                   dropped from the GPU, so the burst loads them all.
"""

from __future__ import annotations

import _thread
import gc
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from harness.engine import Engine, HarnessConfig
from harness.runner import FakeModelRunner, sampled_token

BLOCK = 16
PREFIX = 4 * BLOCK  # the part of a prompt that other requests or the CPU hold
SUFFIX = 2 * BLOCK  # each request's own tokens
MAX_TOKENS = 8
MAX_NUM_SEQS = 256
BATCHED_TOKENS = 4096
# A request holds at most this many blocks: its prompt and its output.
REQUEST_BLOCKS = -(-(PREFIX + SUFFIX + MAX_TOKENS) // BLOCK)
# Prefixes the requests of the other rows draw from. In the offload rows
# they start on the CPU only, and until a load of one lands every request
# admitted with it loads it too.
SHARED_PREFIXES = 64
LOAD_DELAY = 2  # steps a CPU->GPU load stays in flight
MAX_STEPS = 100_000


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    offload: bool = False
    tight: bool = False
    policy: str = "fcfs"
    async_scheduling: bool = False
    # Every request has a prefix of its own (else one of SHARED_PREFIXES).
    own_prefix: bool = False

    def config(self, size: int) -> HarnessConfig:
        # Plenty: every request's blocks at once (an offload burst loads
        # every prefix before it computes any), and a running batch more.
        gpu = (size + MAX_NUM_SEQS) * REQUEST_BLOCKS
        if self.tight and self.offload:
            # Loads take blocks outside the running batch: half the
            # burst's blocks let thousands of them wait in flight.
            gpu = size * REQUEST_BLOCKS // 2
        elif self.tight:
            gpu = MAX_NUM_SEQS * REQUEST_BLOCKS // 5
        return HarnessConfig(
            block_size=BLOCK,
            num_gpu_blocks=gpu,
            # Every block the burst and its set-up compute: no CPU eviction.
            num_cpu_blocks=(size + SHARED_PREFIXES) * REQUEST_BLOCKS,
            offload=self.offload,
            max_num_batched_tokens=BATCHED_TOKENS,
            max_num_seqs=MAX_NUM_SEQS,
            policy=self.policy,
            async_scheduling=self.async_scheduling,
            max_model_len=1024,
            transfer_delay=lambda is_store: 0 if is_store else LOAD_DELAY,
            # The harness's recount of every reservation, and its walk of
            # the queues (O(requests) twice a step, thousands waiting here),
            # would be timed with the scheduler.
            check_reservations=False,
            check_queues=False,
        )


ROWS = {
    r.name: r
    for r in [
        Row("plain", "no connector, plenty of blocks"),
        Row("tight", "no connector, tight pool (preemption)", tight=True),
        Row(
            "tight-priority",
            "no connector, tight pool, priority scheduling",
            tight=True,
            policy="priority",
        ),
        Row(
            "offload-tight",
            "CPU offload, tight pool, async loads in flight",
            offload=True,
            tight=True,
        ),
        Row(
            "offload-async",
            "the same, async scheduling",
            offload=True,
            tight=True,
            async_scheduling=True,
        ),
        Row(
            "offload-burst",
            "CPU offload, plenty of blocks, a burst of CPU hits",
            offload=True,
            own_prefix=True,
        ),
    ]
}


class LightRunner(FakeModelRunner):
    """The harness's fake runner without its content checks: it samples as
    that runner does, so the scheduler makes the same decisions, but it
    neither computes nor checks a content tag per block, which at these
    sizes costs more than the scheduler itself. Whether the KV is right is
    the tests' business, not the benchmark's."""

    def execute(self, so: SchedulerOutput, step: int) -> ModelRunnerOutput:
        computed = self._update_tables(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id, n in so.num_scheduled_tokens.items():
            done = computed[req_id] + n
            prefill_done = done >= self.requests[req_id].num_tokens
            sampled.append([sampled_token(req_id, done)] if prefill_done else [])
        self.forward(f"the forward of step {step}", [], {})
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """`count` random prompts of `length` tokens (ids the fake model knows)."""
    return [rng.choices(range(3, 1000), k=length) for _ in range(count)]


class OverLimit(Exception):
    """The round used up its CPU time."""


class CpuLimit:
    """`with CpuLimit(seconds):` OverLimit is raised in the main thread once
    the process has used `seconds` more CPU time.

    A thread polls time.process_time(). An interval timer on the process's
    CPU clock (ITIMER_PROF) would be simpler, but while one is armed the
    kernel counts the process's CPU time at its ticks only, and
    process_time() would jump by whole milliseconds: most scheduler calls
    would read 0."""

    POLL_SECONDS = 0.2

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False
        self.stop = threading.Event()

    def _fire(self, signum: int, frame: Any) -> None:
        # Called in the main thread; once disarmed, a late call is ignored.
        if self.armed:
            self.armed = False
            raise OverLimit

    def _watch(self, start: float) -> None:
        while not self.stop.wait(self.POLL_SECONDS):
            if time.process_time() - start > self.seconds:
                _thread.interrupt_main(signal.SIGUSR1)
                return

    def __enter__(self) -> CpuLimit:
        self.previous = signal.signal(signal.SIGUSR1, self._fire)
        self.armed = True
        self.watcher = threading.Thread(
            target=self._watch, args=(time.process_time(),), daemon=True
        )
        self.watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        self.stop.set()
        self.watcher.join()
        signal.signal(signal.SIGUSR1, self.previous)


class Timed:
    """The scheduler's CPU time in its schedule() and update_from_output()
    calls, summed since the last `take`, and in all."""

    def __init__(self, e: Engine) -> None:
        self.seconds = self.total = 0.0
        for name in ("schedule", "update_from_output"):
            setattr(e.scheduler, name, self._wrap(getattr(e.scheduler, name)))

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        self.total += seconds
        return seconds


class Bytecodes:
    """The Python bytecodes executed inside the scheduler's schedule() and
    update_from_output() calls (and everything they call), counted by a
    trace function: the same count on any machine and under any load (to
    about 0.1 %: the order of a set of requests follows their addresses),
    where a CPU time moves by a quarter on a shared one. It leaves out what C code
    does (a dict lookup is one bytecode, a sort of a thousand items too), so
    it stands beside the timings as a measure of the Python work the series
    adds, not instead of them. Tracing makes the calls some 30 times slower:
    for small bursts only."""

    def __init__(self, e: Engine) -> None:
        self.count = 0
        for name in ("schedule", "update_from_output"):
            setattr(e.scheduler, name, self._wrap(getattr(e.scheduler, name)))

    def _opcode(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.count += 1
        return self._opcode

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._opcode

    def _wrap(self, fn: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            previous = sys.gettrace()
            sys.settrace(self._call)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.settrace(previous)

        return traced


class Bench:
    """One round of one row: an engine set up, not timed, then bursts of
    requests through it, timed."""

    def __init__(self, row_name: str, size: int, seed: int = 0) -> None:
        self.row, self.size = ROWS[row_name], size
        self.rng = random.Random(f"{row_name}/{size}/{seed}")
        self.e = Engine(self.row.config(size))
        self.e.runner = LightRunner(
            self.e.cfg, self.e.kv, self.e.requests, self.e.cuda.forward
        )
        count = size if self.row.own_prefix else SHARED_PREFIXES
        self.prefixes = prompts(self.rng, count, PREFIX)
        if self.row.offload:
            # Computed once, with a few tokens more so that every release
            # stores the prefix's last block, then dropped from the GPU.
            for prefix in self.prefixes:
                self.e.add_request(prefix + [1, 2, 3], max_tokens=2)
            self.e.run(max_steps=MAX_STEPS)
            self.drop_gpu_cache()

    def drop_gpu_cache(self) -> None:
        """Only the CPU keeps the prefixes now (the offload rows), or
        nothing does: every burst starts as the first."""
        assert self.e.block_pool.reset_prefix_cache(), "blocks still in use"

    def submit(self) -> None:
        for i, suffix in enumerate(prompts(self.rng, self.size, SUFFIX)):
            priority = self.rng.randrange(8) if self.row.policy == "priority" else 0
            prompt = self.prefixes[i % len(self.prefixes)] + suffix
            self.e.add_request(prompt, MAX_TOKENS, priority=priority)

    def run(
        self, window: int, drain: bool, limit: float, bursts: int = 1
    ) -> dict[str, Any]:
        """`bursts` bursts of `size` requests, one after the other (each
        drained, with `drain`): the scheduler's CPU seconds in each of the
        first `window` steps of each, and per burst to drain it. A step is
        one Engine.step(), as one EngineCore step: under async scheduling it
        may only process a step's output.

        A small burst takes a few milliseconds, less than the machine's
        noise: several make a round. A round stops once the process has
        used `limit` CPU seconds (a scheduler that is quadratic in the
        requests takes minutes at 10,000): what it measured is then a lower
        bound, marked by "over_limit" (and "window_cut" when it was cut
        inside a window)."""
        if bursts > 1 and not drain:
            raise ValueError("bursts after the first need the last one drained")
        e = self.e
        timed = Timed(e)
        before = counters(e)
        per_step: list[float] = []
        # Tokens each window step scheduled: where the trees decide
        # differently, a step that schedules more does more.
        step_tokens: list[int] = []
        # Steps taken, and of them in the current burst's window.
        steps = [0, 0]
        over = window_cut = False
        # Set-up garbage collected now, and no collection lands in
        # whichever scheduler call happens to be running.
        gc.collect()
        gc.disable()
        try:
            with CpuLimit(limit):
                for burst in range(bursts):
                    if burst:
                        self.drop_gpu_cache()
                    self.submit()
                    steps[1] = 0
                    while e.busy() and (drain or steps[1] < window):
                        if steps[0] >= MAX_STEPS:
                            raise RuntimeError(f"not drained in {MAX_STEPS} steps")
                        tokens = e.stats.scheduled_tokens
                        e.step()
                        if self._count(timed, window, per_step, steps):
                            step_tokens.append(e.stats.scheduled_tokens - tokens)
        except OverLimit:
            over = True
            # The step cut short took at least what it used (its tokens are
            # not counted: a bound on the cost per token too).
            window_cut = self._count(timed, window, per_step, steps)
        finally:
            gc.enable()
        after = counters(e)
        return {
            "step_seconds": per_step,
            "step_tokens": step_tokens,
            "window": window * bursts,
            "bursts": bursts,
            # Per burst.
            "drain_seconds": timed.total / bursts if drain else None,
            "steps": steps[0] // bursts,
            "over_limit": over,
            # The cut landed in a window: the window's figure is a bound too.
            "window_cut": window_cut,
            # What the scheduler did, to compare the trees' decisions.
            **{name: after[name] - before[name] for name in before},
        }

    def count_bytecodes(self) -> dict[str, Any]:
        """One burst drained with the scheduler's bytecodes counted
        (Bytecodes): the work the scheduler's Python code does, to the set
        orders. The garbage collector is off meanwhile, as in `run`, so no
        finalizer it runs is counted with the scheduler."""
        e = self.e
        counted = Bytecodes(e)
        self.submit()
        steps = 0
        gc.collect()
        gc.disable()
        try:
            while e.busy():
                if steps >= MAX_STEPS:
                    raise RuntimeError(f"not drained in {MAX_STEPS} steps")
                e.step()
                steps += 1
        finally:
            gc.enable()
        return {"bytecodes": counted.count, "steps": steps}

    @staticmethod
    def _count(
        timed: Timed, window: int, per_step: list[float], steps: list[int]
    ) -> bool:
        """A step's scheduler CPU into the figures; True if in a window."""
        seconds = timed.take()
        steps[0] += 1
        if steps[1] >= window:
            return False
        per_step.append(seconds)
        steps[1] += 1
        return True


def counters(e: Engine) -> dict[str, int]:
    """What the engine did so far: requests finished, preemptions, tokens
    scheduled, and CPU->GPU copies the offload worker launched."""
    backend = e.copy_backend
    return {
        "finished": len(e.stats.finished),
        "preemptions": e.stats.preemptions,
        "scheduled_tokens": e.stats.scheduled_tokens,
        "loads": 0
        if backend is None
        else sum(not x["is_store"] for x in backend.launched),
    }
