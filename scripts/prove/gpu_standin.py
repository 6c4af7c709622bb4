"""One vLLM tree's real SimpleCPUOffload code, importable without the rest
of vLLM: what `make test-gpu` runs on the GPU machine.

That machine has PyTorch with CUDA, numpy and cuda-bindings, but none of
what `import vllm` pulls in (pydantic, msgspec, zmq, ...) and no network to
fetch it. The copy path needs none of it: the tree's
`vllm/v1/simple_kv_offload/` package (worker, copy backend, driver calls,
metadata) is imported from the tree as it is, and the few other vLLM names
it imports come from the small modules below, each doing what vLLM's own
does on a CUDA machine. Any other vLLM module is missing on purpose: a
release whose offload code imports one fails to import, naming it, rather
than running against a silent stub.

One tree per process: the stand-ins take the name `vllm`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

PACKAGE = "vllm.v1.simple_kv_offload"
# The tree's modules the checks drive; the package imports what else it
# needs itself (disk_backend and sizing from 0.30).
MODULES = ("worker", "copy_backend", "cuda_mem_ops", "metadata")


class _Platform:
    """vLLM's CudaPlatform, as far as the copy path calls it."""

    device_type = "cuda"

    @staticmethod
    def set_device(device: Any) -> None:
        import torch

        torch.cuda.set_device(device)
        # vLLM makes the context current on the copy thread at once the same
        # way (pytorch#155668): the first driver call there must find it.
        torch.zeros(1, device=device)

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_rocm() -> bool:
        return False


class _KVConnectorMetadata(ABC):  # noqa: B024 (vLLM's own is abstract, empty)
    """Scheduler -> worker metadata: the base the offload metadata extends."""


class _KVConnectorWorkerMetadata(ABC):
    """Worker -> scheduler metadata: the offload's completed stores."""

    @abstractmethod
    def aggregate(self, other: Any) -> Any: ...


class VllmConfig:
    """The worker keeps its config and reads nothing from it on this path."""


def _get_world_group() -> Any:
    # Only reached when torch.distributed is initialized, which it never is
    # in a GPU check of one worker.
    raise RuntimeError("make test-gpu runs one worker: there is no world group")


def _envs_getattr(name: str) -> Any:
    # vllm.envs reads its variables lazily; the copy path reads one.
    if name == "VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS":
        return int(os.getenv(name, "0"))
    raise AttributeError(f"vllm.envs.{name} is not stood in for by gpu_standin.py")


def _standins() -> dict[str, dict[str, Any]]:
    """Module name -> its names. A module with no names is a package that
    loads nothing from disk."""
    return {
        "vllm": {},
        "vllm.v1": {},
        "vllm.utils": {},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.config": {"VllmConfig": VllmConfig},
        "vllm.logger": {"init_logger": logging.getLogger},
        # Pinned memory is available on a CUDA machine that is not WSL.
        "vllm.utils.platform_utils": {"is_pin_memory_available": lambda: True},
        "vllm.utils.torch_utils": {"PIN_MEMORY": True},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.envs": {"__getattr__": _envs_getattr},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorMetadata": _KVConnectorMetadata,
            "KVConnectorWorkerMetadata": _KVConnectorWorkerMetadata,
        },
        "vllm.distributed.parallel_state": {"get_world_group": _get_world_group},
    }


def install(tree: Path) -> types.ModuleType:
    """Make `tree`'s offload package importable as vllm.v1.simple_kv_offload,
    over the stand-ins; returns the package."""
    package_dir = tree / "vllm" / "v1" / "simple_kv_offload"
    if not (package_dir / "worker.py").is_file():
        raise FileNotFoundError(f"{package_dir}/worker.py: not a vLLM tree's offload")
    if "vllm" in sys.modules:
        raise RuntimeError("a vllm package is imported already: one tree a process")
    for name, attrs in _standins().items():
        module = types.ModuleType(name, "stand-in, scripts/prove/gpu_standin.py")
        if not attrs:
            module.__path__ = []  # a package with nothing on disk
        for key, value in attrs.items():
            setattr(module, key, value)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:  # `import vllm.envs as envs` reads it off its parent
            setattr(sys.modules[parent], child, module)
    spec = importlib.util.spec_from_file_location(
        PACKAGE,
        package_dir / "__init__.py",
        submodule_search_locations=[str(package_dir)],
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    sys.modules["vllm.v1"].simple_kv_offload = package
    spec.loader.exec_module(package)
    return package


def load(tree: Path) -> types.SimpleNamespace:
    """The tree's offload modules (worker, copy_backend, cuda_mem_ops,
    metadata), imported over the stand-ins."""
    install(tree)
    return types.SimpleNamespace(
        **{m: importlib.import_module(f"{PACKAGE}.{m}") for m in MODULES}
    )
