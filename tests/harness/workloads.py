"""Generated workloads for the soak: what arrives, when, and what goes wrong.

A workload is a harness configuration plus a plan drawn from a seeded
random generator: requests (shared prefixes, lengths, output lengths),
their arrival steps, aborts, transfers that complete late, and strikes of a
peer engine on a shared pool. The same name and seed give the same plan on
the base and on the series.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.engine import HarnessConfig


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    abort_at: int | None = None  # step at which it is aborted, if still running
    # Position of a token it samples that stops it (Engine.add_request).
    stop_at: int | None = None


@dataclass
class Plan:
    cfg: HarnessConfig
    arrivals: list[Arrival]
    peer_strikes: list[int] = field(default_factory=list)  # steps to arm at
    peer_hold: int = 6  # steps the peer keeps what it took
    check_cpu_content: bool = False  # CPU pool big enough to hold everything


@dataclass(frozen=True)
class Workload:
    name: str
    mirrors: str  # which seed report or condition it exercises
    make: Callable[[random.Random, int], Plan]


def late_transfers(rng: random.Random, most: int) -> Callable[[bool], int]:
    """Each transfer completes 0..most steps after launch."""
    return lambda is_store: rng.randint(0, most)


def prompts_with_shared_prefixes(
    rng: random.Random,
    n: int,
    num_prefixes: int,
    prefix_len: tuple[int, int],
    suffix_len: tuple[int, int],
) -> list[list[int]]:
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(*prefix_len))]
        for _ in range(num_prefixes)
    ]
    return [
        rng.choice(prefixes)
        + [rng.randrange(3, 1000) for _ in range(rng.randint(*suffix_len))]
        for _ in range(n)
    ]


def mixed(hybrid: bool, lazy: bool, peer: bool = False):
    """Many concurrent requests on tiny pools: preemption, aborts, late
    transfers, CPU loads of shared prefixes."""

    def make(rng: random.Random, scale: int) -> Plan:
        cfg = HarnessConfig(
            num_gpu_blocks=72 if hybrid else 56,
            num_cpu_blocks=96,
            hybrid=hybrid,
            sliding_window=48,
            lazy=lazy,
            max_num_batched_tokens=128,
            max_num_seqs=6,
            transfer_delay=late_transfers(rng, 3),
        )
        n = 12 * scale
        prompts = prompts_with_shared_prefixes(rng, n, 4, (32, 200), (1, 120))
        arrivals, step = [], 0
        for prompt in prompts:
            step += rng.choice((0, 0, 1, 2, 5))
            abort = step + rng.randint(1, 30) if rng.random() < 0.15 else None
            arrivals.append(Arrival(step, prompt, rng.randint(1, 24), abort))
        strikes = (
            sorted(rng.sample(range(5, step + 60), k=min(8, scale * 2))) if peer else []
        )
        return Plan(cfg, arrivals, strikes)

    return make


def seed000(rng: random.Random, scale: int) -> Plan:
    """Hybrid + eager offload + chunked prefill: long distinct prompts back
    to back in a pool each one nearly fills (vllm#42085)."""
    cfg = HarnessConfig(
        num_gpu_blocks=52,
        num_cpu_blocks=1024,
        hybrid=True,
        sliding_window=48,
        max_num_batched_tokens=256,
        transfer_delay=late_transfers(rng, 2),
    )
    arrivals, step = [], 0
    for i in range(4 * scale):
        length = rng.randint(400, 445)
        arrivals.append(
            Arrival(
                step, [20_000 * (i + 1) + t for t in range(length)], rng.randint(1, 8)
            )
        )
        step += rng.randint(15, 40)
    return Plan(cfg, arrivals)


def seed002(rng: random.Random, scale: int) -> Plan:
    """Eager offload; requests finish in the step their last full block is
    computed (vllm#41704), then the CPU must hold every computed block."""
    cfg = HarnessConfig(
        num_gpu_blocks=256,
        num_cpu_blocks=4096,
        max_num_batched_tokens=512,
        transfer_delay=late_transfers(rng, 2),
    )
    arrivals = [
        Arrival(
            i * 3,
            [50_000 * (i + 1) + t for t in range(16 * rng.randint(2, 12))],
            max_tokens=1,
        )
        for i in range(10 * scale)
    ]
    return Plan(cfg, arrivals, check_cpu_content=True)


def seed003(rng: random.Random, scale: int) -> Plan:
    """A pool shared with a peer engine that takes blocks between the
    scheduler's count and its allocation (kvcached #262); hybrid groups."""
    cfg = HarnessConfig(
        offload=False,
        hybrid=True,
        num_gpu_blocks=96,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    arrivals = [
        Arrival(
            rng.randint(0, 10 * scale),
            [rng.randrange(3, 1000) for _ in range(rng.randint(60, 300))],
            rng.randint(4, 40),
        )
        for _ in range(8 * scale)
    ]
    strikes = sorted(rng.sample(range(2, 40 * scale), k=4 * scale))
    return Plan(cfg, arrivals, strikes)


def stops_in_flight(rng: random.Random, scale: int) -> Plan:
    """Async scheduling on a pool that CPU hits keep refilling: requests
    stop on a sampled token while their next step is in flight, and
    requests sharing offloaded prefixes load into the blocks they free
    (vllm#47282, vllm#45357)."""
    cfg = HarnessConfig(
        num_gpu_blocks=40,
        num_cpu_blocks=256,
        max_num_batched_tokens=128,
        max_num_seqs=6,
        async_scheduling=True,
        transfer_delay=late_transfers(rng, 2),
    )
    prompts = prompts_with_shared_prefixes(rng, 14 * scale, 3, (48, 160), (1, 60))
    arrivals, step = [], 0
    for prompt in prompts:
        step += rng.choice((0, 1, 2, 4))
        max_tokens = rng.randint(4, 30)
        stop = len(prompt) + rng.randint(1, max_tokens - 1)
        arrivals.append(Arrival(step, prompt, max_tokens, stop_at=stop))
    return Plan(cfg, arrivals)


def overlapped(make: Callable[[random.Random, int], Plan]):
    """A workload's plan under async scheduling."""

    def make_async(rng: random.Random, scale: int) -> Plan:
        plan = make(rng, scale)
        plan.cfg = dataclasses.replace(plan.cfg, async_scheduling=True)
        return plan

    return make_async


WORKLOADS = {
    w.name: w
    for w in [
        Workload("seed000-hybrid-eager", "seed 000: popleft_n assert", seed000),
        Workload("seed002-flush", "seed 002: last block not stored", seed002),
        Workload("seed003-peer", "seed 003: pool raced by a peer", seed003),
        Workload(
            "mixed-full-eager",
            "load: full attention, eager",
            mixed(hybrid=False, lazy=False),
        ),
        Workload(
            "mixed-full-lazy",
            "load: full attention, lazy",
            mixed(hybrid=False, lazy=True),
        ),
        Workload(
            "mixed-hybrid-eager", "load: hybrid, eager", mixed(hybrid=True, lazy=False)
        ),
        Workload(
            "mixed-hybrid-lazy", "load: hybrid, lazy", mixed(hybrid=True, lazy=True)
        ),
        Workload(
            "mixed-hybrid-peer",
            "load: hybrid, eager, raced pool",
            mixed(hybrid=True, lazy=False, peer=True),
        ),
        Workload(
            "async-mixed-full-eager",
            "load under async scheduling: full attention, eager",
            overlapped(mixed(hybrid=False, lazy=False)),
        ),
        Workload(
            "async-mixed-hybrid-lazy",
            "load under async scheduling: hybrid, lazy",
            overlapped(mixed(hybrid=True, lazy=True)),
        ),
        Workload(
            "async-stops-in-flight",
            "seed 004 / vllm#47282: stops with a step in flight, loads reuse",
            stops_in_flight,
        ),
    ]
}
