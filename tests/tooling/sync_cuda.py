"""A CUDA that runs everything at once, in order, on the CPU: enough to run
`make test-gpu`'s worker (scripts/prove/gpu_worker.py) end to end with no
GPU, through each tree's real worker, copy backend and ctypes driver call.

It is an interpreter: `python sync_cuda.py -c CODE` or `python sync_cuda.py
SCRIPT ARGS...` patches torch's CUDA entry points and cuda-bindings' driver,
then runs the code as Python would. A test hands test_gpu.py a shell script
that execs it as --python. Tensors asked for on "cuda" are made on the CPU;
cuMemcpyBatchAsync is a ctypes callback that copies the bytes at once,
reading the addresses, sizes and attributes the tree passes. Since every
kernel and copy completes when launched, nothing can race: a run through it
shows no race anywhere, stale or otherwise.
"""

from __future__ import annotations

import ctypes
import enum
import runpy
import sys
import types
from typing import Any

import torch

# Every batched copy's srcAccessOrder, as the driver would read it.
ORDERS: list[int] = []


class Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cuda_stream = 0

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 10.0


def _on_cpu(make: Any) -> Any:
    def make_on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return make(*args, device=device, **kwargs)

    return make_on_cpu


_FUNC = ctypes.CFUNCTYPE(
    ctypes.c_uint,
    *([ctypes.c_void_p] * 3),
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)


@_FUNC
def _batch_memcpy(dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs, fail, st):
    """cuMemcpyBatchAsync, done before it returns."""
    words = ctypes.c_uint64 * count
    for d, s, n in zip(
        words.from_address(dsts),
        words.from_address(srcs),
        words.from_address(sizes),
        strict=True,
    ):
        ctypes.memmove(d, s, n)
    if num_attrs:  # srcAccessOrder: the first field of CUmemcpyAttributes
        ORDERS.append(ctypes.c_uint.from_address(attrs).value)
    return 0


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0


def _driver() -> types.ModuleType:
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = CUresult  # type: ignore[attr-defined]
    address = ctypes.cast(_batch_memcpy, ctypes.c_void_p).value

    def get_proc_address(name: bytes, version: int, flags: int) -> tuple:
        assert name == b"cuMemcpyBatchAsync", name
        return CUresult.CUDA_SUCCESS, address, 0

    driver.cuGetProcAddress = get_proc_address  # type: ignore[attr-defined]
    driver.cuDriverGetVersion = lambda: (CUresult.CUDA_SUCCESS, 13000)  # type: ignore[attr-defined]
    return driver


def install() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.get_device_name = lambda device=None: "sync CPU stand-in"
    cuda.get_device_capability = lambda device=None: (0, 0)
    cuda.Stream = Stream
    cuda.Event = Event
    torch.Event = Event
    default = Stream()
    cuda.current_stream = lambda device=None: default
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda._sleep = lambda cycles: None
    cuda.cudart = lambda: types.SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: types.SimpleNamespace(value=0)
    )
    torch.zeros = _on_cpu(torch.zeros)
    torch.empty = _on_cpu(torch.empty)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = _driver()  # type: ignore[attr-defined]
    package = types.ModuleType("cuda")
    package.__path__ = []  # type: ignore[attr-defined]
    package.bindings = bindings  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "cuda": package,
            "cuda.bindings": bindings,
            "cuda.bindings.driver": bindings.driver,
        }
    )


def main() -> None:
    install()
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    elif args:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    else:
        sys.exit("usage: sync_cuda.py -c CODE | SCRIPT [ARGS...]")


if __name__ == "__main__":
    main()
