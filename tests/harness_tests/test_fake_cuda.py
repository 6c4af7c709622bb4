"""The fake device sees order within a step, as a GPU would: a store reads
a block's new KV only when it is ordered after the write."""

from __future__ import annotations

import ctypes

import pytest

from harness.fake_cuda import FakeCuda, FakeEvent, Stale, Torn

STREAM, ANY = 1, 3
BLOCK = 1


@pytest.fixture
def cuda():
    steps = [0]
    c = FakeCuda({}, {}, 4, 4, clock=lambda: steps[0], delay=lambda store: 0)
    with c.active():
        yield c


def store(cuda: FakeCuda, order: int) -> None:
    """Issue a GPU->CPU copy of BLOCK on the store stream, as the driver
    would receive it."""
    copy(cuda, is_store=True, order=order)


def compute_event() -> FakeEvent:
    event = FakeEvent()
    event.record()  # the compute stream
    return event


def finish(cuda: FakeCuda) -> object:
    cuda.store.synchronize()
    return cuda.kv["cpu"].get(BLOCK)


def test_store_waiting_for_an_event_after_the_write_reads_it(cuda):
    cuda.compute_write(BLOCK, "kv")
    cuda.store.wait_event(compute_event())
    store(cuda, STREAM)
    assert finish(cuda) == "kv"


def test_store_waiting_for_an_event_before_the_write_reads_stale_kv(cuda):
    early = compute_event()
    cuda.compute_write(BLOCK, "kv")
    cuda.store.wait_event(early)
    store(cuda, STREAM)
    assert isinstance(finish(cuda), Stale)


def test_store_reading_in_any_order_ignores_its_wait(cuda):
    cuda.compute_write(BLOCK, "kv")
    cuda.store.wait_event(compute_event())
    store(cuda, ANY)
    assert isinstance(finish(cuda), Stale)


def test_without_a_wait_only_writes_the_host_saw_done_are_read(cuda):
    cuda.compute_write(BLOCK, "kv")
    store(cuda, ANY)
    assert isinstance(finish(cuda), Stale)
    cuda.host_sync()  # the step ends: the host read its sampled tokens
    store(cuda, ANY)
    assert finish(cuda) == "kv"


def test_a_wait_on_an_event_never_recorded_orders_nothing(cuda):
    cuda.compute_write(BLOCK, "kv")
    cuda.store.wait_event(FakeEvent())
    store(cuda, STREAM)
    assert isinstance(finish(cuda), Stale)


def test_a_wait_sees_the_record_before_it_not_a_later_one(cuda):
    event = compute_event()
    cuda.store.wait_event(event)
    cuda.compute_write(BLOCK, "kv")
    event.record()  # too late: the stream waited for the first record
    store(cuda, STREAM)
    assert isinstance(finish(cuda), Stale)


def test_a_block_written_while_its_store_is_in_flight_is_torn(cuda):
    cuda.compute_write(BLOCK, "kv")
    cuda.store.wait_event(compute_event())
    store(cuda, STREAM)
    cuda.compute_write(BLOCK, "other kv")
    assert finish(cuda) == Torn(BLOCK)


# --- the happens-before checker ------------------------------------------------


def copy(cuda: FakeCuda, is_store: bool, order: int, gpu_block: int = BLOCK) -> None:
    """A batched copy between GPU block `gpu_block` and CPU block BLOCK, on
    the store stream (GPU->CPU) or the load stream (CPU->GPU)."""
    t = cuda.tensors
    gpu = (ctypes.c_uint64 * 1)(t["gpu"].data_ptr() + gpu_block)
    cpu = (ctypes.c_uint64 * 1)(t["cpu"].data_ptr() + BLOCK)
    src, dst = (gpu, cpu) if is_store else (cpu, gpu)
    attrs = ctypes.c_uint(order)
    stream = cuda.store if is_store else cuda.load
    cuda.batch_memcpy(
        ctypes.addressof(dst),
        ctypes.addressof(src),
        0,
        1,
        ctypes.addressof(attrs),
        None,
        1,
        None,
        stream.cuda_stream,
    )


def test_checker_reports_a_store_without_the_compute_done_wait(cuda):
    cuda.forward("the forward", [], {BLOCK: "kv"})
    copy(cuda, is_store=True, order=STREAM)
    (race,) = cuda.races
    assert (race.space, race.block) == ("gpu", BLOCK)
    assert race.first.op.name == "the forward" and race.first.write
    assert race.second.op.stream == "store" and not race.second.write
    assert "read after write on gpu block 1" in str(race)


def test_checker_reports_a_store_whose_event_is_recorded_before_the_forward(cuda):
    early = compute_event()
    cuda.forward("the forward", [], {BLOCK: "kv"})
    cuda.store.wait_event(early)
    copy(cuda, is_store=True, order=STREAM)
    assert [r.first.op.name for r in cuda.races] == ["the forward"]


def test_checker_reports_a_store_whose_event_is_on_the_wrong_stream(cuda):
    cuda.forward("the forward", [], {BLOCK: "kv"})
    event = FakeEvent()
    event.record(cuda.load)  # the copy stream, not compute
    cuda.store.wait_event(event)
    copy(cuda, is_store=True, order=STREAM)
    assert len(cuda.races) == 1


def test_checker_reports_a_store_reading_out_of_stream_order(cuda):
    cuda.forward("the forward", [], {BLOCK: "kv"})
    cuda.store.wait_event(compute_event())
    copy(cuda, is_store=True, order=ANY)
    assert len(cuda.races) == 1


def test_checker_passes_a_store_ordered_after_the_forward(cuda):
    cuda.forward("the forward", [], {BLOCK: "kv"})
    cuda.store.wait_event(compute_event())
    copy(cuda, is_store=True, order=STREAM)
    cuda.forward("the next forward", [BLOCK], {})  # reads it: both read
    assert cuda.races == []


def test_checker_reports_a_load_into_a_block_a_forward_still_reads(cuda):
    cuda.forward("the forward", [BLOCK], {})
    copy(cuda, is_store=False, order=ANY)
    (race,) = cuda.races
    assert "write after read" in str(race)
    assert race.first.op.name == "the forward"
    assert race.second.op.stream == "load" and race.second.write


def test_checker_passes_a_load_after_the_host_saw_the_forward_done(cuda):
    cuda.forward("the forward", [BLOCK], {})
    cuda.host_sync()  # the step's sampled tokens reached the host
    copy(cuda, is_store=False, order=ANY)
    assert cuda.races == []


def test_checker_passes_a_load_ordered_after_the_forward_by_an_event(cuda):
    cuda.forward("the forward", [BLOCK], {})
    cuda.load.wait_event(compute_event())
    copy(cuda, is_store=False, order=STREAM)
    assert cuda.races == []


def test_host_sync_covers_only_the_steps_up_to_its_mark(cuda):
    """Async scheduling: the host reads step N's tokens after launching
    step N+1, which it then does not know done."""
    cuda.forward("step N", [], {})
    mark = cuda.compute_mark()
    cuda.forward("step N+1", [BLOCK], {})
    cuda.host_sync(mark)
    copy(cuda, is_store=False, order=ANY)
    assert [r.first.op.name for r in cuda.races] == ["step N+1"]


def test_checker_reports_a_forward_reading_a_load_in_flight(cuda):
    copy(cuda, is_store=False, order=ANY)
    cuda.forward("the forward", [BLOCK], {})
    (race,) = cuda.races
    assert "read after write" in str(race) and race.first.op.stream == "load"


def test_checker_reports_a_store_into_a_cpu_block_a_load_still_reads(cuda):
    copy(cuda, is_store=False, order=ANY, gpu_block=2)  # reads CPU block 1
    cuda.forward("the forward", [], {BLOCK: "kv"})
    cuda.store.wait_event(compute_event())
    copy(cuda, is_store=True, order=STREAM)  # writes CPU block 1
    assert [(r.space, r.first.op.stream) for r in cuda.races] == [("cpu", "load")]


def test_the_offload_worker_copies_on_the_fake_streams():
    """The worker's own copy streams are the fake ones (the harness does
    not call register_kv_caches): an event it records on its store stream
    marks the store stream, not compute."""
    from harness.engine import Engine, HarnessConfig

    e = Engine(HarnessConfig())
    assert e.worker.load_stream is e.cuda.load
    assert e.worker.store_stream is e.cuda.store
    with e.cuda.active():
        event = FakeEvent()
        event.record(e.worker.store_stream)
    assert event.mark is not None and event.mark.stream == "store"
