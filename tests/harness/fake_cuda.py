"""CPU stand-ins for the CUDA pieces of SimpleCPUOffload's copy path.

The release's own DmaCopyBackend runs (launch_copy, _copy_loop, build_params,
copy_blocks) and so does the worker's store path, whatever each release calls
things. Only what needs a GPU is replaced, and only inside `FakeCuda.active()`:

- `torch.Event` and `torch.cuda.current_stream()`, as the worker and copy
  backend modules see them (their module-level `torch` name is swapped for a
  proxy; nothing else in the process is touched);
- the copy streams, which only record what is issued on them;
- the driver's batch memcpy entry point (cuMemcpyBatchAsync), which records
  each copy with the srcAccessOrder the release passed and the compute events
  its stream was told to wait for.

Order within a step is seen, as a GPU would: every KV write of the fake
runner, event record and copy gets a sequence number. A forward's KV writes
are asynchronous: the host knows them done only at the step's end, when the
sampler copies the step's tokens to it (`host_sync`; the harness schedules
synchronously). A store that reads a block written since then sees the
write only if its stream waited for a compute event recorded after it and
it reads in stream order (STREAM); ANY may read before the stream's waits.
Otherwise it copies `Stale` KV, and a block written again while a copy of
it is in flight copies `Torn` KV: content checks catch either by value,
whatever the structure of the code. Such a store is real: a request that
hits, as a prefix, a block another request computes in the same step has
it stored in that step. Loads are not checked this way.

Copies move content tags between the fake KV caches when an event recorded
after them completes, some steps after launch (`delay`), so a block reused
or read before its transfer completes is caught by value. What the checks
read (`CopyRecord`) is what the driver was handed, not what a patch names.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import itertools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# CUmemcpySrcAccessOrder (CUDA driver API): when a batched copy may read its
# source. STREAM: in stream order, after what the stream waited for; ANY: at
# any time, possibly early, which is only safe for a source nobody writes.
SRC_ACCESS_ORDER = {1: "STREAM", 3: "ANY"}

_handles = itertools.count(1)


@dataclass(frozen=True)
class Mark:
    """Where an event was recorded: a stream, after the operations numbered
    below `seq`."""

    stream: str
    seq: int


@dataclass(frozen=True)
class Stale:
    """What a copy read from a GPU block whose last write it was not ordered
    after: the KV before that write, never a block's right content."""

    block: int
    write_seq: int


@dataclass(frozen=True)
class Torn:
    """What a copy read from a GPU block written again while it was in
    flight."""

    block: int


@dataclass
class CopyRecord:
    """One batched copy as the driver received it."""

    is_store: bool
    pairs: list[tuple[int, int]]
    # srcAccessOrder's name, or None when the call carried no attributes.
    src_access_order: str | None
    # Events the copy stream waited for before this copy was issued.
    waited: list[Mark]
    # Sequence numbers: when the copy was issued, the host's last sync
    # before that, and the last compute write before it.
    issued: int = 0
    synced: int = 0
    last_compute_write: int = 0
    done: bool = False

    def sees(self, write_seq: int) -> bool:
        """Is a compute write (by its sequence number) ordered before this
        copy's read of its source?"""
        if write_seq < self.synced:
            return True
        return self.src_access_order == "STREAM" and any(
            m.stream == "compute" and m.seq > write_seq for m in self.waited
        )


class FakeStream:
    """A stream: the copies issued on it, in order, and its waits."""

    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name = cuda, name
        # The raw handle build_params stores and the driver is called with.
        self.cuda_stream = next(_handles)
        self.waited: list[Mark] = []
        self.copies: list[CopyRecord] = []
        # Work on a stream completes in order: no event before the last one.
        self.ready_at = 0

    def wait_event(self, event: FakeEvent) -> None:
        # CUDA waits for the event's most recent record, so snapshot it now.
        if event.mark is not None:
            self.waited.append(event.mark)

    def synchronize(self) -> None:
        self.cuda.complete(self.copies)


class FakeEvent:
    """torch.Event: on a copy stream it completes `delay` steps after it is
    recorded, carrying out the copies before it; on the compute stream it
    marks the step (the fake runner computes synchronously)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.mark: Mark | None = None
        self._cuda: FakeCuda | None = None
        self._copies: list[CopyRecord] = []
        self._ready_at = 0

    def record(self, stream: FakeStream | None = None) -> None:
        cuda = FakeCuda.current()
        stream = stream or cuda.compute
        self._cuda = cuda
        self.mark = Mark(stream.name, cuda.tick())
        self._copies = [c for c in stream.copies if not c.done]
        if stream is not cuda.compute:
            ready = cuda.clock() + cuda.delay(stream is cuda.store)
            stream.ready_at = self._ready_at = max(ready, stream.ready_at)

    def query(self) -> bool:
        assert self._cuda is not None, "query() of an event never recorded"
        if self._cuda.clock() < self._ready_at:
            return False
        self._cuda.complete(self._copies)
        return True

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.complete(self._copies)


class FakeCuda:
    """One engine's fake device: streams, caches, clock, and the copy log."""

    _active: FakeCuda | None = None

    def __init__(
        self,
        gpu: dict[int, Any],
        cpu: dict[int, Any],
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        clock: Callable[[], int],
        delay: Callable[[bool], int],
    ):
        self.clock, self.delay = clock, delay
        self.kv = {"gpu": gpu, "cpu": cpu}
        self.compute = FakeStream(self, "compute")
        self.load = FakeStream(self, "load")
        self.store = FakeStream(self, "store")
        # One byte per block: the driver sees real addresses, from which the
        # block ids are read back.
        self.tensors = {
            "gpu": torch.zeros(num_gpu_blocks, 1, dtype=torch.uint8),
            "cpu": torch.zeros(num_cpu_blocks, 1, dtype=torch.uint8),
        }
        self.copies: list[CopyRecord] = []
        self._seq = itertools.count(1)
        self.synced = 0
        # GPU block -> sequence number of its last compute write.
        self.last_write: dict[int, int] = {}
        self.last_compute_write = 0

    def tick(self) -> int:
        return next(self._seq)

    def compute_write(self, block: int, tag: Any) -> None:
        """The forward writes KV into a GPU block, on the compute stream."""
        self.kv["gpu"][block] = tag
        self.last_write[block] = self.last_compute_write = self.tick()

    def host_sync(self) -> None:
        """The host waited for the step's sampled tokens: the compute
        stream's writes so far are done."""
        self.synced = self.tick()

    @classmethod
    def current(cls) -> FakeCuda:
        assert cls._active is not None, "a fake CUDA call outside FakeCuda.active()"
        return cls._active

    def _block(self, addr: int) -> tuple[str, int]:
        for space, t in self.tensors.items():
            offset = addr - t.data_ptr()
            if 0 <= offset < t.numel():
                return space, offset
        raise AssertionError(f"copy address {addr:#x} is in neither KV cache")

    def batch_memcpy(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        attrs_idx: Any,
        num_attrs: int,
        fail_idx: Any,
        stream_handle: int,
    ) -> int:
        """cuMemcpyBatchAsync: log the copy on its stream; 0 is success."""
        stream = next(
            s
            for s in (self.load, self.store, self.compute)
            if s.cuda_stream == stream_handle
        )
        src = [self._block(a) for a in (ctypes.c_uint64 * count).from_address(srcs)]
        dst = [self._block(a) for a in (ctypes.c_uint64 * count).from_address(dsts)]
        # srcAccessOrder is the first field of CUmemcpyAttributes.
        order = ctypes.c_uint.from_address(attrs).value if num_attrs else None
        record = CopyRecord(
            is_store=src[0][0] == "gpu",
            pairs=[(s, d) for (_, s), (_, d) in zip(src, dst, strict=True)],
            src_access_order=None if order is None else SRC_ACCESS_ORDER[order],
            waited=list(stream.waited),
            issued=self.tick(),
            synced=self.synced,
            last_compute_write=self.last_compute_write,
        )
        stream.copies.append(record)
        self.copies.append(record)
        return 0

    def complete(self, copies: list[CopyRecord]) -> None:
        for c in copies:
            if not c.done:
                c.done = True
                src, dst = (
                    (self.kv["gpu"], self.kv["cpu"])
                    if c.is_store
                    else (self.kv["cpu"], self.kv["gpu"])
                )
                for s, d in c.pairs:
                    dst[d] = self._read(c, s) if c.is_store else src.get(s)

    def _read(self, c: CopyRecord, block: int) -> Any:
        """What a store read from a GPU block (see the module's docstring)."""
        written = self.last_write.get(block, 0)
        if written > c.issued:
            return Torn(block)
        if written and not c.sees(written):
            return Stale(block, written)
        return self.kv["gpu"].get(block)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this device current for the worker and copy backend."""
        from vllm.v1.simple_kv_offload import copy_backend, cuda_mem_ops, worker

        cuda_ns = types.SimpleNamespace(
            current_stream=lambda device=None: self.compute,
            Stream=FakeStream,
        )
        fake_torch = _TorchProxy(Event=FakeEvent, cuda=cuda_ns)
        # The resolved driver entry point: a function (up to 0.24), or
        # (function, numAttrs) from 0.30.
        if hasattr(cuda_mem_ops, "_batch_memcpy"):
            driver = ("_batch_memcpy", (self.batch_memcpy, 1))
        else:
            driver = ("_batch_memcpy_fn", self.batch_memcpy)
        previous = FakeCuda._active
        FakeCuda._active = self
        saved = [(m, m.torch) for m in (worker, copy_backend)]
        saved_driver = getattr(cuda_mem_ops, driver[0])
        try:
            for m, _ in saved:
                m.torch = fake_torch  # type: ignore[attr-defined]
            setattr(cuda_mem_ops, driver[0], driver[1])
            yield
        finally:
            for m, real in saved:
                m.torch = real  # type: ignore[attr-defined]
            setattr(cuda_mem_ops, driver[0], saved_driver)
            FakeCuda._active = previous


class _TorchProxy(types.SimpleNamespace):
    """`torch` with some names replaced; every other name is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@dataclass
class CopyEngine:
    """The release's DmaCopyBackend on a FakeCuda, copying synchronously.

    Its background thread is stopped after init: each launch_copy is then
    carried out at once by the backend's own _copy_loop, so runs are
    deterministic. `launched` logs each launch with the copy it issued."""

    cuda: FakeCuda
    backend: Any = None
    launched: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend

        self.backend = DmaCopyBackend()
        t = self.cuda.tensors
        with self.cuda.active():
            self.backend.init(
                {"kv": t["gpu"]},
                {"kv": t["cpu"]},
                torch.device("cpu"),
                self.cuda.load,
                self.cuda.store,
            )
        self.backend._queue.put(None)
        self.backend._thread.join()

    def launch_copy(self, *args: Any, **kwargs: Any) -> None:
        call = inspect.signature(self.backend.launch_copy).bind(*args, **kwargs)
        before = len(self.cuda.copies)
        b = self.backend
        b.launch_copy(*args, **kwargs)
        b._queue.put(None)
        b._copy_loop(b._queue, torch.device("cpu"), b._load_stream, b._store_stream)
        a = call.arguments
        self.launched.append(
            {
                "is_store": a["is_store"],
                "event_idx": a["event_idx"],
                "pairs": list(zip(a["src_blocks"], a["dst_blocks"], strict=True)),
                "step": self.cuda.clock(),
                "copies": self.cuda.copies[before:],
            }
        )

    def shutdown(self) -> None:
        pass
