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
    would receive it, and complete it."""
    t = cuda.tensors
    src = (ctypes.c_uint64 * 1)(t["gpu"].data_ptr() + BLOCK)
    dst = (ctypes.c_uint64 * 1)(t["cpu"].data_ptr() + BLOCK)
    attrs = ctypes.c_uint(order)
    cuda.batch_memcpy(
        ctypes.addressof(dst),
        ctypes.addressof(src),
        0,
        1,
        ctypes.addressof(attrs),
        None,
        1,
        None,
        cuda.store.cuda_stream,
    )


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
