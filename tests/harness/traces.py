"""Generated traces for the differential oracle: one seed, one trace.

A trace is a scheduler configuration and what clients do at each step: add
requests (shared prefixes, priorities), open streaming-input sessions and
send their next chunks, end sessions, abort. It covers what the scheduler
does with and without the patches' subjects in play: no KV connector at
all, the CPU offload connector (eager or lazy, so async KV loads and
external tokens), prefix caching on and off, FCFS and priority
scheduling, chunked prefill on and off, hybrid (full + sliding window)
groups, preemption (tiny pools, few sequences) and idle sessions holding
KV. Not yet covered: speculative decoding (an Engine takes
HarnessConfig.num_speculative_tokens, but traces do not vary it yet),
encoder-decoder cross-attention and Mamba groups, which need model runner
support the harness lacks.

Pure Python and seeded: the base and the series rebuild the same trace
from the seed, whatever vLLM they run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# An event: ("add", id, prompt, max_tokens, priority, resumable),
# ("chunk", id, tokens, max_tokens), ("end", id), ("abort", id), or
# ("reset",): run until idle, then empty the GPU prefix cache (what is
# offloaded stays on the CPU, so the next hits there are async loads).
Event = tuple[Any, ...]


@dataclass
class Trace:
    seed: int
    # HarnessConfig fields, plus "max_transfer_delay" (steps a CPU transfer
    # may take to complete, drawn per transfer from the seed).
    cfg: dict[str, Any]
    events: dict[int, list[Event]] = field(default_factory=dict)
    # Which generator made it (FAMILIES).
    family: str = "mixed"

    @property
    def connector(self) -> str:
        if not self.cfg["offload"]:
            return "none"
        return "lazy" if self.cfg["lazy"] else "eager"

    def describe(self) -> str:
        c = self.cfg
        return (
            f"{self.family} seed {self.seed}: connector {self.connector}, "
            f"{'async' if c.get('async_scheduling') else 'sync'} scheduling, "
            f"{'hybrid' if c['hybrid'] else 'full attention'}, "
            f"{c['num_gpu_blocks']} GPU blocks, prefix caching "
            f"{'on' if c['prefix_caching'] else 'off'}, {c['policy']}, chunked "
            f"prefill {'on' if c['enable_chunked_prefill'] else 'off'}, "
            f"max_num_seqs {c['max_num_seqs']}, "
            f"{sum(len(v) for v in self.events.values())} events"
        )

    def last_step(self) -> int:
        return max(self.events, default=0)


def generate(seed: int) -> Trace:
    rng = random.Random(seed)
    connector = rng.choice(["none", "none", "eager", "lazy"])
    hybrid = rng.random() < 0.4
    chunked = rng.random() < 0.85
    max_model_len = 1024
    batched = rng.choice([64, 128, 256]) if chunked else max_model_len
    num_gpu_blocks = rng.randint(10, 40) + (24 if hybrid else 0)
    cfg = {
        "block_size": 16,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": rng.choice([16, 64, 256]),
        "hybrid": hybrid,
        "sliding_window": rng.choice([32, 48, 64]),
        "offload": connector != "none",
        "lazy": connector == "lazy",
        # The offload connector needs the prefix cache.
        "prefix_caching": connector != "none" or rng.random() < 0.6,
        "policy": rng.choice(["fcfs", "priority"]),
        "max_num_batched_tokens": batched,
        "max_num_seqs": rng.randint(2, 8),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "max_transfer_delay": rng.randint(0, 3),
    }
    trace = Trace(seed, cfg)
    # A prompt fits the pool alone, mostly with room to spare: one that
    # never fits only waits, on the base as with the series.
    most_tokens = min(max_model_len - 64, (num_gpu_blocks - 2) * 16 // 2)
    if not chunked:
        most_tokens = min(most_tokens, batched - 64)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(16, 160))] for _ in range(3)
    ]

    def add(step: int, event: Event) -> None:
        trace.events.setdefault(step, []).append(event)

    step = 0
    for n in range(rng.randint(4, 14)):
        step += rng.choice((0, 0, 1, 2, 4, 8))
        prompt = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = prompt + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))]
        prompt = prompt[: rng.randint(8, max(8, most_tokens))]
        req_id = f"r{n}"
        resumable = rng.random() < 0.3
        max_tokens = rng.randint(1, 4) if resumable else rng.randint(1, 12)
        add(step, ("add", req_id, prompt, max_tokens, rng.randint(0, 3), resumable))
        if resumable:
            # A session: chunks some steps apart (it sits idle, holding its
            # KV, in between), then its end.
            at = step
            for _ in range(rng.randint(1, 3)):
                at += rng.randint(2, 40)
                tokens = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
                add(at, ("chunk", req_id, tokens, rng.randint(1, 4)))
            add(at + rng.randint(1, 20), ("end", req_id))
        elif rng.random() < 0.1:
            add(step + rng.randint(1, 30), ("abort", req_id))
    return trace


def generate_offload(seed: int) -> Trace:
    """A liveness scenario for the CPU offload connector: a few prefixes run
    once, so they are offloaded; the GPU prefix cache emptied, so that the
    requests that follow load them from the CPU as async loads; then 4 to
    12 arrivals over a few steps, of mixed priorities and sizes, each of
    which fits the pool alone. Whatever the release completes here, the
    series must complete too (a stall is an outage nobody is told about)."""
    rng = random.Random(seed)
    hybrid = rng.random() < 0.4
    num_gpu_blocks = rng.randint(40, 120)
    cfg = {
        "block_size": 16,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": 256,
        "hybrid": hybrid,
        "sliding_window": rng.choice([32, 48, 64]),
        "offload": True,
        "lazy": rng.random() < 0.5,
        "prefix_caching": True,
        "policy": rng.choice(["fcfs", "priority"]),
        "max_num_batched_tokens": rng.choice([128, 256, 512]),
        "max_num_seqs": rng.randint(4, 16),
        "max_model_len": 4096,
        "enable_chunked_prefill": True,
        "max_transfer_delay": rng.randint(0, 4),
    }
    trace = Trace(seed, cfg, family="offload")
    # Blocks a prompt may take: it must fit the pool alone, with its
    # sliding-window blocks too when hybrid.
    most_blocks = (num_gpu_blocks - 2) // (2 if hybrid else 1)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(16 * rng.randint(4, most_blocks // 2))]
        for _ in range(rng.randint(1, 4))
    ]
    for n, prefix in enumerate(prefixes):
        trace.events.setdefault(0, []).append(("add", f"p{n}", prefix, 1, 0, False))
    trace.events[1] = [("reset",)]
    step = 2
    for n in range(rng.randint(4, 12)):
        step += rng.choice((0, 0, 1, 1, 2, 3))
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
        prompt += [rng.randrange(3, 1000) for _ in range(rng.randint(1, 16 * 30))]
        prompt = prompt[: 16 * most_blocks - 16]
        event = ("add", f"r{n}", prompt, rng.randint(1, 8), rng.randint(0, 3), False)
        trace.events.setdefault(step, []).append(event)
    return trace


def overlapped(generate_family, name: str):
    """The same traces under async scheduling, as vLLM runs on a GPU by
    default: step N+1 is scheduled and launched before step N's output is
    processed (output placeholders live, blocks freed while a step in
    flight still uses them, transfers unordered with compute unless an
    event orders them)."""

    def make(seed: int) -> Trace:
        trace = generate_family(seed)
        trace.cfg["async_scheduling"] = True
        trace.family = name
        return trace

    make.__doc__ = f"{generate_family.__name__}'s traces, under async scheduling."
    return make


# Trace families: the differential oracle's general traces, the liveness
# scenarios of the CPU offload connector, and both under async scheduling.
FAMILIES = {
    "mixed": generate,
    "offload": generate_offload,
    "async-mixed": overlapped(generate, "async-mixed"),
    "async-offload": overlapped(generate_offload, "async-offload"),
}
