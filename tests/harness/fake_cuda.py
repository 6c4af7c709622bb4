"""CPU stand-ins for the CUDA pieces of SimpleCPUOffload's copy path, with
the order a GPU gives them.

The release's own DmaCopyBackend runs (launch_copy, _copy_loop, build_params,
copy_blocks) and so does the worker, whatever each release calls things.
Only what needs a GPU is replaced, and only inside `FakeCuda.active()`:
`torch.Event` and `torch.cuda.current_stream()` as the worker and copy
backend modules see them (their module-level `torch` name is swapped for a
proxy; nothing else in the process is touched), the copy streams, and the
driver's batch memcpy entry point (cuMemcpyBatchAsync).

**Order, as CUDA defines it.** Each stream is a queue of operations in
launch order. The forward is one operation on the compute stream that reads
the KV blocks every scheduled request attends to and writes the blocks of
the tokens it computes; each batched copy is one operation on its copy
stream that reads its source blocks and writes its destination blocks (a
store reads GPU blocks and writes CPU blocks, a load the reverse).
`Event.record` marks a position in its stream; `wait_event` and
`wait_stream` order everything a stream launches later after that
position; the host learns what precedes a position when it synchronizes on
it (`Event.synchronize`, an `Event.query` that returns True,
`Stream.synchronize`, or `host_sync`, the copy of a step's sampled tokens),
and what it launches afterwards, on any stream, comes after. This is a
vector clock per stream and one for the host. A copy with
srcAccessOrder=ANY may read its source out of stream order: its read is
ordered only after what the host knew when it launched the copy.

**The checker.** Every access to a block (GPU or CPU) is checked against
the accesses before it: a write unordered with an earlier read or write of
the same block, or a read unordered with the write before it, is a `Race`,
naming the block, both operations and their streams. A real GPU may run
two unordered operations in either order, so any such pair can corrupt KV,
however the harness happened to interleave them.

**Content.** The CPU-side bookkeeping stays what a synchronous run gives:
the forward's KV tags land when it is launched, a copy's when an event
recorded after it completes (`delay` steps after launch). Where order is
missing, content shows it too: a store reading a block whose last write is
not ordered before its read copies `Stale` KV, and one whose block is
written again, unordered, while it is in flight copies `Torn` KV, so
content checks catch either by value. A load's destination is written
when the load completes.

**What this model does not capture.** Copy engines running several copies
of one stream at once (CUDA keeps stream order, so this changes nothing the
checker needs); CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL (no release uses
it); host threads (the copy thread's launches are made synchronously, in
the order the worker queues them, which is the order its queue gives them
on a GPU); memory the host writes directly (the KV caches are only written
by kernels and copies); the forward's layers (one operation: a copy that
waits for any part of it waits for all of it, which is what the worker's
events give); a kernel's reads or writes of blocks outside what the
scheduler gave it (the zeroing of new blocks a Mamba hybrid asks for, and a
copy on write, are the fake runner's compute operations ahead of the
forward, as vLLM's runner launches them); and what two unordered writes of
a GPU block leave: content keeps one of them (a zeroing and a load leave
the loaded KV), so such a race shows in the checker only.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import itertools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# CUmemcpySrcAccessOrder (CUDA driver API): when a batched copy may read its
# source. STREAM: in stream order, after what the stream waited for; ANY: at
# any time, possibly early, which is only safe for a source nobody writes.
SRC_ACCESS_ORDER = {1: "STREAM", 3: "ANY"}

_handles = itertools.count(1)

Clock = dict[str, int]


def _join(a: Clock, b: Clock) -> Clock:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


@dataclass(frozen=True)
class Mark:
    """Where an event was recorded: a stream, after the operations numbered
    below `seq` (a number shared by every stream, in host order)."""

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


@dataclass(frozen=True)
class Op:
    """One operation on a stream: the `pos`-th of its stream, `seq`-th in
    host order, after what `clock` says."""

    name: str
    stream: str
    pos: int
    seq: int
    clock: Clock = field(hash=False, compare=False)

    def before(self, clock: Clock) -> bool:
        """Is this operation ordered before a point with this clock?"""
        return clock.get(self.stream, 0) >= self.pos


@dataclass(frozen=True)
class Access:
    """An operation's read or write of a block; `after` is the clock the
    access is ordered after (the operation's, or less for an ANY read)."""

    op: Op
    write: bool
    after: Clock = field(hash=False, compare=False)


@dataclass(frozen=True)
class Race:
    """Two accesses of one block that nothing orders: a GPU may run them
    either way round."""

    space: str
    block: int
    first: Access
    second: Access

    def __str__(self) -> str:
        kind = {
            (True, True): "write after write",
            (False, True): "write after read",
            (True, False): "read after write",
        }[(self.first.write, self.second.write)]
        verb = {True: "writes", False: "reads"}
        return (
            f"{kind} on {self.space} block {self.block}: "
            f"{self.second.op.name} ({self.second.op.stream} stream) "
            f"{verb[self.second.write]} it, unordered with "
            f"{self.first.op.name} ({self.first.op.stream} stream), which "
            f"{verb[self.first.write]} it"
        )


@dataclass
class _BlockHistory:
    """The accesses a new one must be ordered after: the last write, and
    the latest read of each stream since (an earlier read of a stream is
    ordered before whatever its latest one is)."""

    write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)


@dataclass
class CopyRecord:
    """One batched copy as the driver received it."""

    is_store: bool
    pairs: list[tuple[int, int]]
    # srcAccessOrder's name, or None when the call carried no attributes.
    src_access_order: str | None
    # Events the copy stream waited for before this copy was issued.
    waited: list[Mark]
    op: Op | None = None
    # Host-order numbers: when the copy was issued, and the last compute
    # write before it.
    issued: int = 0
    last_compute_write: int = 0
    # What each source block held at launch, as the copy's read sees it.
    read: dict[int, Any] = field(default_factory=dict)
    done: bool = False


class FakeStream:
    """A stream: a queue of operations, as a vector clock, and its copies."""

    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name = cuda, name
        # The raw handle build_params stores and the driver is called with.
        self.cuda_stream = next(_handles)
        self.clock: Clock = {}
        self.count = 0
        self.waited: list[Mark] = []
        self.copies: list[CopyRecord] = []
        # Work on a stream completes in order: no event before the last one.
        self.ready_at = 0

    def wait_event(self, event: FakeEvent) -> None:
        # CUDA waits for the event's most recent record, so snapshot it now.
        if event.mark is not None:
            self.waited.append(event.mark)
            self.clock = _join(self.clock, event.clock)

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(Mark(other.name, self.cuda.tick()))
        self.clock = _join(self.clock, other.clock)

    def synchronize(self) -> None:
        self.cuda.host_knows(self.clock)
        self.cuda.complete(self.copies)


class FakeEvent:
    """torch.Event: on a copy stream it completes `delay` steps after it is
    recorded, carrying out the copies before it; on the compute stream the
    fake runner's work is done once launched, so it completes at once."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.mark: Mark | None = None
        self.clock: Clock = {}
        self._cuda: FakeCuda | None = None
        self._copies: list[CopyRecord] = []
        self._ready_at = 0

    def record(self, stream: FakeStream | None = None) -> None:
        cuda = FakeCuda.current()
        stream = stream or cuda.compute
        self._cuda = cuda
        self.mark = Mark(stream.name, cuda.tick())
        self.clock = dict(stream.clock)
        self._copies = [c for c in stream.copies if not c.done]
        if stream is not cuda.compute:
            ready = cuda.clock() + cuda.delay(stream is cuda.store)
            stream.ready_at = self._ready_at = max(ready, stream.ready_at)

    def query(self) -> bool:
        assert self._cuda is not None, "query() of an event never recorded"
        if self._cuda.clock() < self._ready_at:
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.host_knows(self.clock)
            self._cuda.complete(self._copies)


class FakeCuda:
    """One engine's fake device: streams, caches, clock, the copy log and
    the races seen."""

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
        self.races: list[Race] = []
        self._seq = itertools.count(1)
        # What the host knows complete: what it launches later comes after.
        self.host: Clock = {}
        self._history: dict[tuple[str, int], _BlockHistory] = {}
        # GPU block -> the forward that last wrote it.
        self.last_write: dict[int, Op] = {}
        self.last_compute_write = 0

    def tick(self) -> int:
        return next(self._seq)

    # --- order ------------------------------------------------------------
    def host_knows(self, clock: Clock) -> None:
        self.host = _join(self.host, clock)

    def host_sync(self, mark: Clock | None = None) -> None:
        """The host waited for a step's sampled tokens: the compute stream's
        work up to `mark` (a clock from `compute_mark`; all of it when None)
        is done."""
        self.host_knows(self.compute.clock if mark is None else mark)

    def compute_mark(self) -> Clock:
        """Where the compute stream is now (for a later `host_sync`)."""
        return dict(self.compute.clock)

    def _launch(self, stream: FakeStream, name: str) -> Op:
        stream.count += 1
        clock = _join(stream.clock, self.host)
        clock[stream.name] = stream.count
        stream.clock = clock
        return Op(name, stream.name, stream.count, self.tick(), clock)

    def _access(self, space: str, block: int, access: Access) -> None:
        h = self._history.setdefault((space, block), _BlockHistory())
        before = [h.write] if h.write else []
        if access.write:
            before += h.reads.values()
        for a in before:
            if a.op.stream != access.op.stream and not a.op.before(access.after):
                self.races.append(Race(space, block, a, access))
        if access.write:
            h.write, h.reads = access, {}
        else:
            h.reads[access.op.stream] = access

    # --- operations ---------------------------------------------------------
    def forward(self, name: str, reads: Iterable[int], writes: dict[int, Any]) -> Op:
        """The forward, on the compute stream: attends to `reads`, writes
        `writes` (GPU block -> the KV tag it now holds)."""
        op = self._launch(self.compute, name)
        for block in reads:
            self._access("gpu", block, Access(op, False, op.clock))
        for block, tag in writes.items():
            self._access("gpu", block, Access(op, True, op.clock))
            self.kv["gpu"][block] = tag
            self.last_write[block] = op
        if writes:
            self.last_compute_write = op.seq
        return op

    def compute_write(self, block: int, tag: Any) -> None:
        """A forward that only writes one block."""
        self.forward("a compute write", (), {block: tag})

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
        """cuMemcpyBatchAsync: one copy operation on its stream; 0 is
        success."""
        stream = next(
            s
            for s in (self.load, self.store, self.compute)
            if s.cuda_stream == stream_handle
        )
        src = [self._block(a) for a in (ctypes.c_uint64 * count).from_address(srcs)]
        dst = [self._block(a) for a in (ctypes.c_uint64 * count).from_address(dsts)]
        # srcAccessOrder is the first field of CUmemcpyAttributes.
        order = ctypes.c_uint.from_address(attrs).value if num_attrs else None
        src_order = None if order is None else SRC_ACCESS_ORDER[order]
        is_store = src[0][0] == "gpu"
        op = self._launch(stream, f"{'store' if is_store else 'load'} copy")
        # Out of stream order (ANY), a read comes only after what the host
        # knew at launch.
        read_after = op.clock if src_order == "STREAM" else dict(self.host)
        record = CopyRecord(
            is_store=is_store,
            pairs=[(s, d) for (_, s), (_, d) in zip(src, dst, strict=True)],
            src_access_order=src_order,
            waited=list(stream.waited),
            op=op,
            issued=op.seq,
            last_compute_write=self.last_compute_write,
        )
        for space, block in src:
            self._access(space, block, Access(op, False, read_after))
            if is_store:
                record.read[block] = self._read_at_launch(block, read_after)
        for space, block in dst:
            self._access(space, block, Access(op, True, op.clock))
        stream.copies.append(record)
        self.copies.append(record)
        return 0

    def _read_at_launch(self, block: int, after: Clock) -> Any:
        """What a store reads from a GPU block: its KV, or Stale when the
        write that made it is not ordered before the read."""
        writer = self.last_write.get(block)
        if writer is not None and not writer.before(after):
            return Stale(block, writer.seq)
        return self.kv["gpu"].get(block)

    def complete(self, copies: list[CopyRecord]) -> None:
        for c in copies:
            if c.done:
                continue
            c.done = True
            if c.is_store:
                for s, d in c.pairs:
                    writer = self.last_write.get(s)
                    rewritten = writer is not None and writer.seq > c.issued
                    torn = rewritten and not c.op.before(writer.clock)
                    self.kv["cpu"][d] = Torn(s) if torn else c.read[s]
            else:
                for s, d in c.pairs:
                    self.kv["gpu"][d] = self.kv["cpu"].get(s)

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
