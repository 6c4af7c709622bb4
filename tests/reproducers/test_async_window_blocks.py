"""Reproducer for patch 0012: under async scheduling, sliding-window blocks
are dropped by the tokens whose KV is processed, not by those scheduled.

A prefill chunk writes the KV of every token it computes, in every group:
a sliding-window group too, in blocks the next chunk no longer attends to.
With async scheduling the next chunk is scheduled while that one still
runs on the GPU, and releases before 0.26.0 count it computed already:
allocate_slots drops the window blocks it writes and the pool hands them
to a request that hits the CPU cache in the same schedule. The load, on
its own stream, writes them unordered with the forward still writing
them (upstream frees by processed tokens from 0.26.0, vllm#47728). On a
CPU the fake CUDA's happens-before checker (harness.fake_cuda) reports
the pair.
"""

from __future__ import annotations

from harness.engine import Engine, HarnessConfig
from harness.offload_checks import load_races

BS = 16
PREFIX = list(range(100, 100 + 4 * BS + 3))
# Prefilled in chunks of 128 tokens: each drops most of the window blocks
# the chunk before it wrote.
LONG = list(range(5000, 5000 + 12 * BS))


def run(async_scheduling: bool) -> Engine:
    """PREFIX is computed, offloaded and dropped from the GPU cache; LONG
    starts its chunked prefill, and PREFIX comes again at once: it hits
    the CPU cache, and the pool (28 blocks) is nearly all LONG's."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=28,
            num_cpu_blocks=128,
            hybrid=True,
            sliding_window=32,
            max_num_batched_tokens=128,
            async_scheduling=async_scheduling,
        )
    )
    e.add_request(PREFIX, max_tokens=2)
    e.run()
    assert e.block_pool.reset_prefix_cache()
    e.add_request(LONG, max_tokens=4)
    e.add_request(PREFIX + [7, 8], max_tokens=3)
    e.run(max_steps=400)
    return e


def test_a_load_never_overwrites_window_blocks_a_step_in_flight_writes():
    e = run(async_scheduling=True)
    assert any(not x["is_store"] for x in e.copy_backend.launched), "a CPU hit"
    assert load_races(e) == []
    assert e.runner.violations == []
    assert e.stats.finished >= set(e.requests)


def test_synchronous_scheduling_drops_window_blocks_as_before():
    e = run(async_scheduling=False)
    assert load_races(e) == []
    assert e.stats.finished >= set(e.requests)


def test_without_a_connector_window_blocks_are_dropped_as_before():
    """Without a connector that writes reused blocks from its own stream the
    compute stream orders every reuse: window blocks are dropped as the
    release drops them. Holding them a step longer makes a long prefill on
    a tight hybrid pool preempt itself again and again (the differential's
    async-mixed trace 70, which the release completes)."""
    from harness import trace_worker

    record = trace_worker.run(70, "async-mixed")
    assert record["crash"] is None and record["violation"] is None
    assert not record["stalled"]


def test_a_request_that_stops_keeps_every_block_its_step_in_flight_reads():
    """A request that stops on a sampled token has its next step in flight:
    that step computes one more token and attends to the window behind it.
    When the request finishes, the window blocks dropped before its blocks
    go to the connector must be those the processed tokens left behind,
    not those the in-flight token will: a block freed there goes straight
    back to the pool while the forward still reads it."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=32,
            num_cpu_blocks=64,
            hybrid=True,
            sliding_window=32,
            async_scheduling=True,
        )
    )
    forward = e.runner.forward
    reads: list[list[int]] = []

    def record_reads(name, step_reads, writes):
        reads.append(list(step_reads))
        return forward(name, step_reads, writes)

    e.runner.forward = record_reads
    # It stops on the token sampled at position 46; the step in flight then
    # computes token 46, whose window (tokens 15-46) reaches the first
    # window block by its last token.
    r = e.add_request(list(range(100, 140)), max_tokens=40, stop_at=46)
    while r not in e.stats.finished:
        e.step()
    assert e.in_flight, "its next step is in flight when it stops"
    freed = [b for b in reads[-1] if e.block_pool.blocks[b].ref_cnt == 0]
    assert freed == [], f"blocks the step in flight reads are free: {freed}"
    e.run()
    assert load_races(e) == []


def test_window_blocks_are_still_dropped_once_their_step_is_processed():
    """Counting the tokens in flight delays the drop by a step; it must not
    stop it. A long decode under async scheduling with a connector holds
    about the window's blocks in the window group, not one per block of
    the sequence."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=64,
            num_cpu_blocks=128,
            hybrid=True,
            sliding_window=32,
            max_num_batched_tokens=128,
            async_scheduling=True,
        )
    )
    assert e.scheduler.defer_block_free
    r = e.add_request(LONG, max_tokens=160)  # 22 blocks in all
    held: list[int] = []
    while e.busy():
        e.step()
        if r in e.scheduler.requests:
            window_ids = e.scheduler.kv_cache_manager.get_block_ids(r)[1]
            held.append(sum(b != 0 for b in window_ids))
    assert r in e.stats.finished
    # The prefill's second chunk is allocated while the first still runs:
    # the whole 12-block prompt. Decoding, the window (32 tokens) and the
    # token in flight fit in 4 blocks.
    assert max(held) <= 12, f"the window group held {max(held)} blocks"
    assert held[-1] <= 4, f"the window group held {held[-1]} blocks at the end"
    assert e.runner.violations == []


def test_mamba_align_state_blocks_are_dropped_once_their_step_is_processed():
    """The drop by processed tokens covers the Mamba group too. In align
    mode it keeps one state block per step and frees the one of two steps
    back; with a step in flight that block is only old enough a step later,
    when allocate_slots has already recorded the next one. It must still
    be freed then, not held until the request ends: a 640-token prompt in
    64-token chunks held 11 state blocks at its peak before this was
    counted. A step in flight reads the state of the one before it and
    writes its own, and the next step's block is allocated: three."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=160,
            num_cpu_blocks=256,
            mamba="align",
            max_num_batched_tokens=64,
            async_scheduling=True,
        )
    )
    assert e.scheduler.defer_block_free
    r = e.add_request(list(range(7000, 7640)), max_tokens=24)
    held: list[int] = []

    def count_state_blocks(e: Engine) -> None:
        if r in e.scheduler.requests:
            state_ids = e.scheduler.kv_cache_manager.get_block_ids(r)[-1]
            held.append(sum(b != 0 for b in state_ids))

    e.run(after_step=count_state_blocks)  # which checks nothing is left behind
    assert r in e.stats.finished
    assert max(held) <= 3, f"the Mamba group held {max(held)} blocks at its peak"
    assert e.runner.violations == [] and e.cuda.races == []


def test_a_mamba_align_prefill_cut_short_leaves_nothing_to_free_later():
    """The state blocks kept to be freed later belong to the request's
    blocks of now: a request aborted in the middle of its prefill (or
    preempted, to allocate again from its first block) must take them
    along, or they name blocks of another allocation. Engine.run() checks
    that no per-request state is left once every request is done."""
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=160,
            num_cpu_blocks=256,
            mamba="align",
            max_num_batched_tokens=64,
            async_scheduling=True,
        )
    )
    r = e.add_request(list(range(7000, 7640)), max_tokens=24)
    for _ in range(4):
        e.step()
    e.abort(r)
    e.run()
    assert e.runner.violations == [] and e.cuda.races == []
