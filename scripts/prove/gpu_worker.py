"""Seed 004's store race and the load races on a real GPU, against one vLLM
tree's own SimpleCPUOffloadWorker and DmaCopyBackend.

Not for direct use: scripts/prove/test_gpu.py (make test-gpu) runs it once
per tree of its bundle, in a Python with PyTorch (CUDA), numpy and
cuda-bindings; the tree's offload code is imported over the stand-ins of
gpu_standin.py. It writes one JSON document (--out): the device, the
settings, and per check the counts the judge (gpu_judge.py) reads.

Each race check holds the compute stream back with torch.cuda._sleep
(--sleep-ms of GPU time), queues a kernel behind it that touches one KV
block, and has the tree copy that block from or to the CPU while the kernel
waits, --reps times:

  store       the worker's own store path (bind the step's metadata,
              wait_for_save, get_finished) right after a fill of the block:
              the CPU copy must hold what the fill wrote; a store unordered
              with compute copies the block's old KV (seed 004, vllm#45704)
  store-bare  the same store launched through the tree's copy backend with
              no wait and srcAccessOrder ANY, as releases up to 0.23.0 do:
              the control that shows the race window is exercised
  load        the worker's own load path into a block a kernel in flight
              still reads: the kernel reads the loaded KV, since nothing
              orders a load after compute (why the scheduler must keep
              loads off blocks a step in flight uses: vllm#47282, 0012)
  zero        the same load into a block the compute stream zeroes (the
              Mamba runner zeroing new blocks, vllm#48481): the zeroing
              wipes the loaded KV

Each repetition ends `race` (the stale or overwritten KV), `clean`, `torn`
(a mix) or `missing` (the copy wrote nothing). Then a store of
--timing-blocks blocks is timed through the tree's own driver call with the
barrier (compute-done event, stream wait, srcAccessOrder STREAM) and
without (no wait, ANY), --timing-rounds rounds, alternating.

--check-imports only imports the tree's offload code and builds its worker,
which needs no GPU: the bundle's self-check.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from prove import gpu_standin

LAYER = "kv.0"
NUM_BLOCKS = 32
BLOCK_BYTES = 1 << 20
# A CPU block holds this before a store: never a KV value of a check.
SENTINEL = 255
# CUmemcpySrcAccessOrder (CUDA driver API).
STREAM, ANY = 1, 3
# A copy of a MiB not done in 30 s never will be.
WAIT_S = 30.0
RACE_CHECKS = ("store", "store-bare", "load", "zero")


def verdict(values: set[int], clean: int, race: int) -> str:
    """A block's bytes, judged: all `clean`, all `race`, all SENTINEL (the
    copy never wrote it), or a mix (torn)."""
    if values == {clean}:
        return "clean"
    if values == {race}:
        return "race"
    if values == {SENTINEL}:
        return "missing"
    return "torn"


def rep_values(i: int) -> tuple[int, int]:
    """(old, new) KV byte of repetition i: distinct from each other, from
    0 (a zeroed block) and from SENTINEL, and changing every repetition."""
    old = 1 + (2 * i) % 200
    return old, old + 1


def kv_cache_config(num_blocks: int, block_bytes: int) -> SimpleNamespace:
    """One KV cache tensor of one layer, blocks outermost, as each release's
    worker reads it: up to 0.24 from the tensor's storage (`num_blocks`),
    from 0.30 from the tensor's placement (layers, strides, offset)."""
    tensor = SimpleNamespace(
        size=num_blocks * block_bytes,
        shared_by=[LAYER],
        layers=[LAYER],
        layer_stride=0,
        block_stride=block_bytes,
        offset=0,
        host_resident=False,
    )
    return SimpleNamespace(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[]
    )


def make_worker(mods: SimpleNamespace) -> Any:
    return mods.worker.SimpleCPUOffloadWorker(
        gpu_standin.VllmConfig(),
        kv_cache_config(NUM_BLOCKS, BLOCK_BYTES),
        NUM_BLOCKS * BLOCK_BYTES,
    )


def with_order(params: Any, order: int) -> Any:
    """The tree's copy parameters with another srcAccessOrder (every release
    keeps them in a NamedTuple with a ctypes attributes struct)."""
    return params._replace(attrs=type(params.attrs)(srcAccessOrder=order))


class Rig:
    """The tree's worker on the GPU: 32 blocks of 1 MiB, a pinned CPU cache
    of as many, and the compute stream (this thread's current one)."""

    def __init__(self, mods: SimpleNamespace, cycles: int) -> None:
        import torch

        self.torch, self.mods, self.cycles = torch, mods, cycles
        self.worker = make_worker(mods)
        self.gpu = torch.zeros(
            NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device="cuda"
        )
        self.worker.register_kv_caches({LAYER: self.gpu})
        (cpu,) = self.worker.cpu_kv_caches.values()
        self.cpu = cpu.view(torch.uint8)
        self.backend = self.worker._backend
        self.read = torch.empty(BLOCK_BYTES, dtype=torch.uint8, device="cuda")
        self.last_event = 0

    def close(self) -> None:
        self.backend.shutdown()

    def values(self, block: Any) -> set[int]:
        return set(self.torch.unique(block).tolist())

    def event(self) -> int:
        # One counter for both streams: each stream's indices must rise.
        self.last_event += 1
        return self.last_event

    def wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            if not self.backend._thread.is_alive():
                raise RuntimeError(f"{what}: the copy thread died")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not done after {WAIT_S:.0f} s")
            # Sleeping lets the copy thread take the GIL and launch at once.
            time.sleep(0.0002)

    def step(self, **fields: Any) -> None:
        """One engine step of the connector, in the runner's order:
        start_load_kv, wait_for_save, get_finished (releases up to 0.29
        launch both kinds in get_finished, later ones in the first two)."""
        w = self.worker
        w.bind_connector_metadata(self.mods.metadata.SimpleCPUOffloadMetadata(**fields))
        w.start_load_kv()
        w.wait_for_save()
        w.get_finished(set())
        w.clear_connector_metadata()

    def store_reported(self, idx: int) -> Callable[[], bool]:
        seen: set[int] = set()

        def done() -> bool:
            self.worker.get_finished(set())
            meta = self.worker.build_connector_worker_meta()
            if meta is not None:
                seen.update(meta.completed_store_events)
            return idx in seen

        return done

    def load(self, gpu_block: int, cpu_block: int) -> None:
        idx = self.event()
        self.step(
            load_event=idx,
            load_gpu_blocks=[gpu_block],
            load_cpu_blocks=[cpu_block],
            load_event_to_reqs={idx: ["gpu-check"]},
        )

        def done() -> bool:
            self.worker.get_finished(set())
            return idx not in self.worker._pending_load_event_indices

        self.wait(done, f"load {idx}")

    def hold_compute(self) -> None:
        self.torch.cuda._sleep(self.cycles)

    # --- the checks: one repetition each ------------------------------------
    def store(self, i: int) -> str:
        old, new = rep_values(i)
        block = 1 + i % 8
        self.prepare(block, old)
        self.hold_compute()
        self.gpu[block].fill_(new)
        idx = self.event()
        self.step(store_event=idx, store_gpu_blocks=[block], store_cpu_blocks=[block])
        self.wait(self.store_reported(idx), f"store {idx}")
        self.torch.cuda.synchronize()
        return verdict(self.values(self.cpu[block]), new, old)

    def store_bare(self, i: int) -> str:
        old, new = rep_values(i)
        block = 1 + i % 8
        self.prepare(block, old)
        self.hold_compute()
        self.gpu[block].fill_(new)
        idx, events = self.event(), []
        params = self.backend._store_params
        # launch_copy puts the parameters in its queue item: swapped for this
        # one launch only.
        self.backend._store_params = with_order(params, ANY)
        try:
            self.backend.launch_copy(
                [block], [block], is_store=True, event_idx=idx, events_list=events
            )
        finally:
            self.backend._store_params = params
        self.wait(lambda: bool(events) and events[-1][1].query(), f"bare store {idx}")
        self.torch.cuda.synchronize()
        return verdict(self.values(self.cpu[block]), new, old)

    def prepare(self, block: int, old: int) -> None:
        self.gpu[block].fill_(old)
        self.torch.cuda.synchronize()
        self.cpu[block].fill_(SENTINEL)

    def load_under_read(self, i: int) -> str:
        old, new = rep_values(i)
        block, cpu_block = 1 + i % 8, 16 + i % 8
        self.gpu[block].fill_(old)
        self.cpu[cpu_block].fill_(new)
        self.torch.cuda.synchronize()
        self.hold_compute()
        self.read.copy_(self.gpu[block])  # the kernel in flight reads the block
        self.load(block, cpu_block)
        self.torch.cuda.synchronize()
        return verdict(self.values(self.read), old, new)

    def zero_vs_load(self, i: int) -> str:
        old, new = rep_values(i)
        block, cpu_block = 1 + i % 8, 16 + i % 8
        self.gpu[block].fill_(old)
        self.cpu[cpu_block].fill_(new)
        self.torch.cuda.synchronize()
        self.hold_compute()
        self.gpu[block].zero_()  # the runner zeroing a new block
        self.load(block, cpu_block)
        self.torch.cuda.synchronize()
        return verdict(self.values(self.gpu[block]), new, 0)

    def repeat(self, name: str, reps: int) -> dict[str, Any]:
        one = {
            "store": self.store,
            "store-bare": self.store_bare,
            "load": self.load_under_read,
            "zero": self.zero_vs_load,
        }[name]
        counts = dict.fromkeys(("race", "clean", "torn", "missing"), 0)
        start = time.monotonic()
        for i in range(reps):
            counts[one(i)] += 1
        return {"reps": reps, **counts, "seconds": time.monotonic() - start}

    # --- the barrier's cost -------------------------------------------------
    def time_barrier(self, rounds: int, blocks: int) -> dict[str, Any]:
        """Host time from launch to done of one store of `blocks` blocks, the
        compute stream idle: with the barrier and without, per round."""
        torch = self.torch
        params = self.backend._store_params
        stream = self.backend._store_stream
        copy = self.mods.cuda_mem_ops.copy_blocks
        ordered, unordered = with_order(params, STREAM), with_order(params, ANY)
        ids = list(range(blocks))

        def once(barrier: bool) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            if barrier:
                compute_done = torch.Event()
                compute_done.record(torch.cuda.current_stream())
                stream.wait_event(compute_done)
            copy(ids, ids, ordered if barrier else unordered)
            end = torch.Event()
            end.record(stream)
            end.synchronize()
            return time.perf_counter() - start

        for _ in range(3):  # warm-up, not counted
            once(True)
            once(False)
        with_s, without_s, ratios = [], [], []
        for r in range(rounds):
            # Each round times both back to back, in turn first.
            if r % 2:
                b, u = once(True), once(False)
            else:
                u, b = once(False), once(True)
            with_s.append(b)
            without_s.append(u)
            ratios.append(b / u)
        ratios.sort()
        return {
            "rounds": rounds,
            "blocks": blocks,
            "block_bytes": BLOCK_BYTES,
            "with_ms": statistics.median(with_s) * 1e3,
            "without_ms": statistics.median(without_s) * 1e3,
            "ratio": statistics.median(ratios),
            "ratio_q1": ratios[len(ratios) // 4],
            "ratio_q3": ratios[(3 * len(ratios)) // 4],
        }

    def shipped(self) -> dict[str, Any]:
        """How the tree ships its store: the parameters' srcAccessOrder and
        whether its copy backend takes an event to wait for."""
        order = self.backend._store_params.attrs.srcAccessOrder
        launch = inspect.signature(self.backend.launch_copy).parameters
        return {
            "store_order": {STREAM: "STREAM", ANY: "ANY"}.get(order, str(order)),
            "wait_event": "wait_event" in launch,
        }


def sleep_cycles(ms: float) -> tuple[int, float]:
    """torch.cuda._sleep cycles that hold the stream about `ms`, measured on
    this GPU (the clock differs by GPU and load); and the probe's ms."""
    import torch

    probe, elapsed = 20_000_000, 0.0
    for _ in range(2):  # the first one pays for loading the kernel
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end)
    return max(1, int(probe * ms / max(elapsed, 1e-3))), elapsed


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        info["cuda_bindings"] = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        info["cuda_bindings"] = None
    try:
        from cuda.bindings import driver

        _, version = driver.cuDriverGetVersion()
        info["driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception as e:  # informative only
        info["driver_api"] = f"unknown ({e})"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout else None
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def run_checks(mods: SimpleNamespace, args: Any) -> dict[str, Any]:
    """Every check on this tree; an error is kept in the document, for the
    judge, rather than raised."""
    import torch

    doc: dict[str, Any] = {
        "tree": str(args.tree),
        "settings": {
            "reps": args.reps,
            "sleep_ms": args.sleep_ms,
            "timing_rounds": args.timing_rounds,
            "timing_blocks": args.timing_blocks,
            "block_bytes": BLOCK_BYTES,
        },
        "device": {},
        "checks": {},
        "error": None,
    }
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        doc["device"] = device_info()
        cycles, probe_ms = sleep_cycles(args.sleep_ms)
        doc["settings"].update(sleep_cycles=cycles, probe_ms=probe_ms)
        rig = Rig(mods, cycles)
    except Exception:
        doc["error"] = traceback.format_exc()
        return doc
    try:
        doc["shipped"] = rig.shipped()
        for name in RACE_CHECKS:
            try:
                doc["checks"][name] = result = rig.repeat(name, args.reps)
                say(
                    f"    {name}: race {result['race']}, clean {result['clean']}, "
                    f"torn {result['torn']}, missing {result['missing']} "
                    f"of {args.reps}"
                )
            except Exception:
                doc["checks"][name] = {"error": traceback.format_exc()}
        try:
            doc["checks"]["timing"] = rig.time_barrier(
                args.timing_rounds, args.timing_blocks
            )
        except Exception:
            doc["checks"]["timing"] = {"error": traceback.format_exc()}
    finally:
        rig.close()
    return doc


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--tree", type=Path, required=True, help="the vLLM tree to run")
    p.add_argument("--out", type=Path, help="where to write the JSON document")
    p.add_argument(
        "--check-imports",
        action="store_true",
        help="only import the tree's offload code and build its worker (no GPU)",
    )
    p.add_argument("--reps", type=int, default=100, help="repetitions per race check")
    p.add_argument(
        "--sleep-ms", type=float, default=20.0, help="how long compute is held back"
    )
    p.add_argument("--timing-rounds", type=int, default=41, help="timed stores")
    p.add_argument(
        "--timing-blocks", type=int, default=16, help="blocks per timed store"
    )
    args = p.parse_args()
    if args.reps < 1 or args.timing_rounds < 1 or args.sleep_ms <= 0:
        raise ForkError("--reps and --timing-rounds must be >= 1, --sleep-ms > 0")
    if not 1 <= args.timing_blocks <= NUM_BLOCKS:
        raise ForkError(f"--timing-blocks must be between 1 and {NUM_BLOCKS}")
    if not args.check_imports and args.out is None:
        raise ForkError("--out FILE is needed (or --check-imports)")
    try:
        mods = gpu_standin.load(args.tree.resolve())
    except (FileNotFoundError, ImportError) as e:
        raise ForkError(f"cannot import the offload code of {args.tree}: {e}") from e
    if args.check_imports:
        make_worker(mods)
        launch = inspect.signature(mods.copy_backend.DmaCopyBackend.launch_copy)
        print(json.dumps({"ok": True, "wait_event": "wait_event" in launch.parameters}))
        return 0
    doc = run_checks(mods, args)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    main_guard(main)
