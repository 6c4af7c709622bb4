"""Probes of reports in upstream's record that the fork did not carry a fix
for when they were scanned (docs/ledger-scan.md lists the scan;
docs/ledger.md the rows). A row the fork came to carry on some releases
keeps its probe, which then pins the bare releases' outcome and the
series' alike.

Each test pins what a release does, as its own code decides: the branch a
release takes is chosen by the code that has the bug (an assertion's text,
a counter that exists or not), never by a version number. So the test
passes on every bare release and on every series, and it fails the day a
series changes the outcome: then the ledger row it names is out of date
(a backport landed, or a release fixed it), and the row is updated with
the test.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from harness import runner
from harness.engine import Engine, HarnessConfig
from harness.engine_core import held_gpu_blocks, offload_engine, step_as_engine_core
from harness.mamba import (
    PROMPT,
    attention_evicted_past_the_mamba_state,
    mamba_engine,
    prompt_on_the_cpu_only,
    skip_where_a_load_is_refused,
)
from harness.offload_checks import first_chunk_and_loads, loaded_blocks
from harness.prefix_match_unit import (
    PMU_PROMPT,
    pmu_engine,
    tail_on_a_lazy_cpu_only,
)
from harness.sync_load import allocate_with_external_tokens

EXTENSION = list(range(900, 917))


def source_has(obj: object, text: str) -> bool:
    return text in inspect.getsource(obj)


# --- ledger row offload-reset-unsupported ----------------------------------


def test_the_cpu_tier_is_cleared_only_where_the_connector_can_reset():
    """reset_prefix_cache(reset_connector=True), as after a weight update:
    0.19.0-0.23.0's SimpleCPUOffloadConnector raises NotImplementedError
    after the GPU prefix cache was already cleared, and the next request
    still loads the prompt from the CPU tier (KV of the old weights); from
    0.24.0 the reset succeeds and the next request computes its prompt."""
    e = Engine(HarnessConfig(num_gpu_blocks=32, num_cpu_blocks=32))
    prompt = list(range(100, 148))
    e.add_request(prompt, max_tokens=3)
    e.run()
    can_reset = hasattr(e.offload, "reset")
    if can_reset:
        assert e.scheduler.reset_prefix_cache(reset_connector=True)
    else:
        with pytest.raises(NotImplementedError):
            e.scheduler.reset_prefix_cache(reset_connector=True)
    assert e.block_pool.get_num_free_blocks() == e.cfg.num_gpu_blocks - 1
    e.add_request(prompt + EXTENSION, max_tokens=2)
    loaded = loaded_blocks(e)
    if can_reset:
        assert not loaded, "the CPU tier still served a prompt after its reset"
    else:
        assert loaded, "the CPU tier the reset could not clear serves the prompt"
    assert e.runner.violations == []


# --- ledger row mamba-align-external-hit-assert ------------------------------


def test_a_cpu_hit_on_a_mamba_align_hybrid():
    """Up to 0.22.1 the scheduler's Mamba block-aligned split asserts that
    no connector reports a hit: any CPU hit on a Mamba 'align' hybrid
    kills the engine (vllm#42554 removed the assertion in 0.23.0)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    # The fork's 0022 (0.19.0-0.22.1) keeps the assertion for synchronous
    # loads and skips the split for an async one, as 0.23.0 on do.
    asserts = source_has(
        Scheduler, "External KV connector is not verified yet"
    ) and not source_has(Scheduler, "and not load_kv_async")
    e = mamba_engine("align")
    prompt_on_the_cpu_only(e)
    e.add_request(PROMPT + EXTENSION, max_tokens=2)
    if asserts:
        with pytest.raises(AssertionError, match="not verified yet"):
            e.run()
        return
    assert loaded_blocks(e), "the extension loads its prefix from the CPU"


# --- ledger row hybrid-connector-hit-divergence -------------------------------


def test_a_mamba_state_deeper_than_the_attention_hit():
    """A Mamba hybrid with a connector: the prompt's last attention blocks
    are evicted from the GPU prefix cache while its Mamba state block
    survives. Bare 0.24.0-0.26.0 take the deepest group's hit (max over
    the groups) as the local hit, so the request skips tokens whose
    attention KV nobody computes or loads: it reads zeroed blocks, no error
    (vllm#46453, fixed by vllm#48425 in 0.27.0). Up to 0.23.0 the local
    hit is the groups' common one (0.19.0-0.22.1 refuse the load: a skip);
    from 0.27.0, and on the fork's series of 0.24.0-0.26.0 (the row is
    carried there; its reproducer is
    tests/reproducers/test_mamba_state_deeper_than_attention.py), the
    attention group's, or the common one where a group hit deeper. Which
    outcome is pinned follows the code: the max is what the fix removes."""
    from vllm.v1.core.sched.scheduler import Scheduler

    takes_max = source_has(Scheduler, "max(per_group_hits)")
    e = mamba_engine("align")
    prompt = list(range(100, 164))
    attention_evicted_past_the_mamba_state(e, prompt, kept_blocks=2)
    e.add_request(prompt + EXTENSION, max_tokens=2)
    with skip_where_a_load_is_refused("align"):  # up to 0.22.1
        e.run()
    if takes_max:
        missing = {(v.group, v.index, v.got) for v in e.runner.violations}
        assert (0, 2, ("zeroed",)) in missing
        assert (0, 3, ("zeroed",)) in missing
    else:
        assert e.runner.violations == []


# --- ledger row offload-idle-store-holds-blocks --------------------------------


def test_an_engine_stepped_only_while_it_has_work_and_its_last_store():
    """EngineCore steps only while the scheduler has requests. A store
    launched in a request's last steps completes in a later step, so where
    nothing keeps the engine stepping for it, the engine idles with the
    store in flight: its GPU blocks stay held, and the prefix-cache reset of
    a weight update refuses (reset_running_requests=True raises). 0.33.0's
    connector keeps the engine stepping while it has stores queued or in
    flight (has_pending_push_work) and the reset succeeds."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        simple_cpu_offload_connector as connector_module,
    )

    keeps_stepping = source_has(connector_module, "def has_pending_push_work")
    # One block of prefill per step: the prompt's second block is computed
    # in the step that finishes the request; stores complete two steps on.
    e = offload_engine(store_delay=2, max_num_batched_tokens=16)
    e.add_request(list(range(100, 132)), max_tokens=1)
    step_as_engine_core(e)
    held = held_gpu_blocks(e)
    if keeps_stepping:
        assert held == 0
        assert e.scheduler.reset_prefix_cache()
    else:
        assert held > 0, "the idle engine's store in flight holds GPU blocks"
        assert not e.scheduler.reset_prefix_cache()


# --- ledger row offload-lazy-idle-store-loop -----------------------------------


def test_a_lazy_engine_kept_stepping_for_its_stores():
    """Lazy mode's scan stores free cached GPU blocks from the free queue's
    head in every step, one that schedules nothing too. Where the connector
    keeps an idle engine stepping while any store is in flight (0.30.0's
    has_pending_push_work, in lazy mode as in eager), and the CPU tier is
    smaller than what the GPU prefix cache holds, each empty step's scan
    starts a store of blocks whose CPU copies the last store evicted: the
    engine never goes idle. The releases before 0.30.0 have no keep-alive,
    the fork's (0023) answers in eager mode only, and where it answers in
    lazy mode too (0024 on 0.19.0-0.29.0, R11 on 0.30.0-0.33.0) no lazy
    store starts in a step taken for stores alone
    (_stepping_only_for_stores): those go idle. Which outcome is pinned
    follows the code."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        simple_cpu_offload_connector as connector_module,
    )
    from vllm.v1.simple_kv_offload import manager as manager_module

    # The connector's own answer: up to 0.29.0 the base class's (False).
    hook = vars(connector_module.SimpleCPUOffloadConnector).get("has_pending_push_work")
    lazy_kept_alive = hook is not None and "_lazy_mode" not in inspect.getsource(hook)
    loops = lazy_kept_alive and not source_has(
        manager_module, "def _stepping_only_for_stores"
    )
    e = offload_engine(
        store_delay=1,
        lazy=True,
        num_gpu_blocks=8,
        num_cpu_blocks=4,
        max_num_batched_tokens=32,
    )
    for i in range(3):
        e.add_request(list(range(100 + 40 * i, 140 + 40 * i)), max_tokens=2)
    if loops:
        with pytest.raises(AssertionError, match="still stepping"):
            step_as_engine_core(e, max_steps=300)
        assert not e.scheduler.requests, "every request finished"
    else:
        step_as_engine_core(e, max_steps=300)
        assert not e.scheduler.requests, "every request finished"


# --- ledger row session-stop-counted-twice ------------------------------------


def test_sessions_stopped_twice_by_output_in_flight():
    """Under async scheduling a session that stops on a stop token has its
    next step in flight; where that step's token reaches max_tokens, its
    output stops the session a second time, and the second stop counts it
    again among the sessions waiting for input. Closing the session takes
    it off the count once: each such session leaves 1 behind, which the
    scheduler subtracts from its unfinished requests (EngineCore steps only
    while there are some) and, from 0.25.0, adds to the running ones at
    admission. Where the stop drops the output in flight (0.31.0 on) there
    is no second stop. Which outcome is pinned follows the code."""
    if "resumable" not in inspect.signature(Request.__init__).parameters:
        pytest.skip("no streaming input in this release")
    e = Engine(HarnessConfig(offload=False, async_scheduling=True, max_num_seqs=2))
    # The double stop queues the session twice before 0.31.0 (the strict
    # xfail in test_queue_state.py); this probe is about what follows.
    e.raise_queue_violations = False
    for k in range(2):
        prompt = [1000 * (k + 1) + t for t in range(20)]
        session = e.add_request(prompt, 2, f"s{k}", resumable=True, stop_at=20)
        # A request that runs beside it, as traffic does (the stop token
        # is sampled in a step shared with it).
        e.add_request([1000 * (k + 1) + 500 + t for t in range(30)], 8)
        for _ in range(10):
            e.step()
        e.add_request([0], 1, session)  # its client closes the session
        for _ in range(20):
            e.step()
    scheduler = e.scheduler
    counted = getattr(scheduler, "num_waiting_for_streaming_input", None)
    new = {e.add_request([5000 + 100 * i + t for t in range(16)], 4) for i in range(4)}
    stop = scheduler._handle_stopped_request
    if any(source_has(stop, f"num_stale_{n}") for n in ("output_tokens", "steps")):
        # The stop drops the output in flight (0.31.0 on; the series from
        # 0.19.0, whose reproducers are in test_session_stops_once.py).
        assert counted == 0
        step_as_engine_core(e, max_steps=60)
        assert new <= e.stats.finished
    elif source_has(scheduler.schedule, "num_waiting_for_streaming_input"):
        # Admission counts the 2 leaked with the running ones: no room at
        # max_num_seqs 2, with nothing running and every block free.
        assert counted == 2, "each session stopped twice leaves 1 counted"
        with pytest.raises(AssertionError, match="still stepping"):
            step_as_engine_core(e, max_steps=60)
        assert not new & e.stats.finished and not scheduler.running
        assert held_gpu_blocks(e) == 0
    else:
        # Admission reads the running requests alone, but the unfinished
        # count is 2 short: EngineCore stops stepping, and blocks on its
        # input queue, while the last 2 of the 4 still run.
        assert counted == 2, "each session stopped twice leaves 1 counted"
        step_as_engine_core(e, max_steps=60)
        assert new - e.stats.finished, "the engine idles with requests left"
        assert scheduler.get_num_unfinished_requests() <= 0


# --- ledger row mamba-sync-external-hit-count ---------------------------------


def test_a_synchronous_external_hit_on_mamba_align_is_counted_one_block_short():
    """vllm#46892 (open PR): MambaManager counts 1 block (plus the
    speculative ones) for a first prefill, but with external tokens loaded
    in the same step it takes one for the external state and one for the
    new token. At the smallest free count the count accepts, the pool runs
    dry inside the allocation: on every bare release, and on the series
    without R12, the engine would die in schedule(). The series before R12
    names the wrong count (0002's check) instead of the pool's bare
    ValueError. Reached from the scheduler on 0.23.0-0.33.0 by a connector
    that loads synchronously (DecodeBenchConnector); SimpleCPUOffload's
    loads are async, and counted exactly. R12 (the series of 0.23.0-0.33.0)
    counts the block; its reproducers are in
    tests/reproducers/test_mamba_sync_external_hit.py."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    outcomes = [
        allocate_with_external_tokens("mamba_align", 64, 1, k)[0] for k in range(12)
    ]
    first = next(i for i, o in enumerate(outcomes) if o != "refused")
    if source_has(MambaManager, "_num_loaded_state_blocks"):
        assert first == 7 and outcomes[first] == "allocated", outcomes
        return
    assert first == 6, outcomes  # the count: 5 attention blocks and 1 Mamba
    assert outcomes[first + 1] == "allocated", outcomes
    if hasattr(kv_cache_utils, "KVCacheCorruptionError"):
        assert outcomes[first].startswith("KVCacheCorruptionError"), outcomes
        assert "the count is wrong" in outcomes[first]
    else:
        assert outcomes[first] == "ValueError: Cannot get 1 free blocks from the pool"


# --- lead: SimpleCPUOffload with prefix_match_unit ---------------------------


def test_an_eager_cpu_hit_inside_an_attention_block(monkeypatch):
    """Eager SimpleCPUOffload hashed every 8 tokens: a 44-token prompt
    computed (3 output tokens), stored and dropped from the GPU, then the
    prompt plus 17 tokens. Up to 0.29.0 the CPU tier holds whole blocks
    only: the hit is 32 tokens (two attention blocks and the Mamba state at
    32). From 0.30.0 (vllm#54736) the connector also stores, when a request
    finishes, the attention block holding the prompt's last hash boundary
    (_find_fa_partial_tail_source), and the hit is 40: three attention
    blocks and the Mamba state at 40. That block was copied after the
    first request's decode steps, so it holds 14 tokens at 32-45: the 8
    the hit covers, then 6 of the first request's own. No token reads those
    6 positions: the step that loads the block computes from 40 to the
    block's end and writes them before its attention reads them, as a GPU
    runner writes a step's KV before attention, which reads no key past a
    sequence's length. Harmless; the fake runner's content check accepts
    an attention block that holds more than a step reads (holds_past)."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    stores_the_tail = hasattr(SimpleCPUOffloadScheduler, "_find_fa_partial_tail_source")
    # The blocks the content check took holding more than a step reads.
    taken: list[tuple[Any, Any]] = []
    check = runner.holds_past

    def holds_past(got: Any, want: Any, kind: str, own_full: Any = None) -> bool:
        held = check(got, want, kind, own_full)
        if held:
            taken.append((got, want))
        return held

    monkeypatch.setattr(runner, "holds_past", holds_past)
    e = pmu_engine()
    prompt_on_the_cpu_only(e, PMU_PROMPT)
    req_id = e.add_request(PMU_PROMPT + EXTENSION, max_tokens=2)
    (_, start, num_new), loaded = first_chunk_and_loads(e, req_id)
    assert req_id in e.stats.finished
    assert e.cuda.races == [] and e.runner.violations == []
    if not stores_the_tail:
        assert (start, len(loaded)) == (32, 3)
        assert taken == []
        return
    assert (start, len(loaded)) == (40, 4)
    assert start + num_new >= 48, "that step writes every position past the hit"
    # Block #2: the hit's 8 tokens, then 6 of the first request's own.
    [(got, want)] = taken
    assert (len(want[3]), len(got[3])) == (8, 14)


def test_a_lazy_cpu_hit_at_a_prompt_tail_inside_a_block():
    """Ledger row offload-lazy-partial-hit-assert. Lazy SimpleCPUOffload
    hashed every 8 tokens: the scan copies free cached GPU blocks under
    their own keys, and the GPU caches the block holding a 44-token
    prompt's tail under the key at 40. With the prompt on the CPU only, a
    request that extends it gets a 40-token CPU hit where the lazy CPU
    coordinator serves hits finer than a block (0.26.0-0.29.0), and
    update_state_after_alloc asserts it is no multiple of every group's
    block size: EngineCore dies in schedule(). From 0.30.0, and on the
    series of 0.26.0-0.29.0 (R14), a lazy tier serves block-aligned hits
    only: the hit is 32 and loads cleanly."""
    e = pmu_engine(lazy=True)
    fine = e.offload.cpu_coordinator.enable_partial_hash_hits
    tail_on_a_lazy_cpu_only(e)
    req_id = e.add_request(PMU_PROMPT + EXTENSION, max_tokens=2)
    if fine:
        with pytest.raises(AssertionError, match="num_external_tokens=40 not aligned"):
            e.run()
        return
    (_, start, _), loaded = first_chunk_and_loads(e, req_id)
    assert (start, len(loaded)) == (32, 3)
    assert req_id in e.stats.finished
    assert e.runner.violations == [] and e.cuda.races == []
