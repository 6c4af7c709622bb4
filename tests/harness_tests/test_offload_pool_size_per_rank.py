"""Probe for ledger row offload-pool-size-per-rank (vllm#52921): with
pipeline parallelism each worker holds its own stage's layers, and the
scheduler's KV cache config is the first stage's (EngineCore:
generate_scheduler_kv_cache_config copies kv_cache_configs[0]; num_blocks is
unified). SimpleCPUOffload's scheduler side sizes the CPU pool from that
config and the per-rank byte budget, each worker from its own tensors' bytes
per block: a stage with more layers (an uneven split, or draft layers on the
last stage) gets fewer CPU blocks than the scheduler hands out.

One process, the real classes: the scheduler side is the harness Engine's
(stage 0's layout: one layer); each stage's worker is the release's
SimpleCPUOffloadConnector in the worker role, its register_kv_caches given
the stage's caches (CUDA streams, pinning and the copy backend stubbed: only
the sizing runs). Then a second worker, for stage 1, copies on its own fake
CUDA with a CPU pool of the size its sizing gave, fed every step's
connector metadata: where the scheduler's pool is larger, the first store
to a CPU block past stage 1's pool is a copy outside its CPU tensor. 0.33.0
aligns the pool (workers all-reduce MIN; EngineCore reads the workers'
count through the executor before the scheduler is built and sets
cache_config.simple_cpu_offload_num_blocks): emulated here as EngineCore
does it, with the executor's real get_simple_cpu_offload_num_blocks over
the two workers' counts. Which outcome is pinned follows the code."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E501
    SimpleCPUOffloadConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

import harness.engine as harness_engine
from harness.config import PAGE_BYTES, HarnessConfig, group_spec, make_vllm_config
from harness.engine import Engine
from harness.fake_cuda import FakeCuda, _TorchProxy
from harness.runner import FakeKV, FakeModelRunner, make_offload_worker

G, C, BS = 64, 32, 16  # GPU blocks, the scheduler's CPU budget in blocks, tokens
PAGE = PAGE_BYTES * BS  # bytes of one layer's block
PROMPTS = [list(range(1000 * i, 1000 * i + 4 * BS)) for i in range(1, 9)]


def cfg() -> HarnessConfig:
    return HarnessConfig(block_size=BS, num_gpu_blocks=G, num_cpu_blocks=C)


def stage_config(layers: int) -> KVCacheConfig:
    """A pipeline stage's KV cache config: `layers` full-attention layers,
    each with its own region, and the unified num_blocks."""
    names = [f"full.{i}" for i in range(layers)]
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in fields:  # up to 0.28: a tensor per layer
        tensors = [KVCacheTensor(size=PAGE * G, shared_by=[n]) for n in names]
    else:  # from 0.29: one allocation placing its layers
        tensors = [
            KVCacheTensor(
                size=PAGE * G * layers,
                layers=names,
                layer_stride=PAGE * G,
                block_stride=PAGE,
            )
        ]
    spec = group_spec(cfg(), "full", BS)
    return KVCacheConfig(
        num_blocks=G,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def stage_caches(config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """The per-layer caches a stage's model runner binds, on the CPU: views
    of one allocation (from 0.29), or a tensor per layer."""
    names = config.kv_cache_groups[0].layer_names
    if len(config.kv_cache_tensors) == len(names) and len(names) > 1:
        return {n: torch.zeros(G, PAGE // 2, dtype=torch.float16) for n in names}
    raw = torch.zeros(len(names) * G * PAGE, dtype=torch.int8)
    return {
        n: raw[i * G * PAGE : (i + 1) * G * PAGE].view(torch.float16).view(G, -1)
        for i, n in enumerate(names)
    }


class _NoStream:
    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)

    def __init__(self, *args, **kwargs):
        pass


class _NoBackend:
    def init(self, *args, **kwargs):
        pass


def worker_pool_size(
    monkeypatch: pytest.MonkeyPatch, vllm_config, config: KVCacheConfig
) -> int:
    """The CPU blocks the release's worker allocates for a stage: its
    connector in the worker role, registered with the stage's caches."""
    from vllm.v1.simple_kv_offload import worker as worker_module

    with monkeypatch.context() as m:
        proxy = _TorchProxy(cuda=types.SimpleNamespace(Stream=_NoStream))
        m.setattr(worker_module, "torch", proxy)
        m.setattr(worker_module, "DmaCopyBackend", _NoBackend)
        m.setattr(worker_module, "pin_tensor", lambda t: None, raising=False)
        m.setattr(worker_module, "PIN_MEMORY", False, raising=False)
        connector = SimpleCPUOffloadConnector(
            vllm_config, KVConnectorRole.WORKER, config
        )
        connector.register_kv_caches(stage_caches(config))
        worker = connector.worker_handler
        assert worker.cpu_kv_caches, "the worker allocated its CPU pool"
        rows = {t.shape[0] for t in worker.cpu_kv_caches.values()}
        assert rows == {worker.num_cpu_blocks}
        return worker.num_cpu_blocks


def stage_pool_sizes(monkeypatch: pytest.MonkeyPatch, vllm_config) -> list[int]:
    """Stage 0's (one layer) and stage 1's (two layers) worker pool sizes."""
    return [worker_pool_size(monkeypatch, vllm_config, stage_config(n)) for n in (1, 2)]


def aligned_count(counts: list[int]) -> int | None:
    """What EngineCore hands the scheduler from its workers' counts, where
    the release does (0.33.0: the executor's min of the workers' reports)."""
    from vllm.v1.executor.abstract import Executor

    get = getattr(Executor, "get_simple_cpu_offload_num_blocks", None)
    if get is None:
        return None
    return get(types.SimpleNamespace(collective_rpc=lambda method: list(counts)))


def two_stage_engine(monkeypatch, aligned: int | None):
    """The harness Engine (its scheduler has stage 0's config; its own
    worker is stage 0's, pool C) and a stage-1 worker with two layers,
    copying on its own fake CUDA with the pool its sizing gives, fed the
    same connector metadata every step. Returns the engine, stage 1's pool
    size and runner, and the CPU block ids every store named."""

    def engine_core_config(c):
        config = make_vllm_config(c)
        if aligned is not None:  # EngineCore, before it builds the scheduler
            config.cache_config.simple_cpu_offload_num_blocks = aligned
        return config

    monkeypatch.setattr(harness_engine, "make_vllm_config", engine_core_config)
    e = Engine(cfg())
    stage1 = stage_config(2)
    pool1 = worker_pool_size(monkeypatch, e.vllm_config, stage1)
    kv1 = FakeKV()
    cuda1 = FakeCuda(
        kv1.gpu, kv1.cpu, G, pool1, clock=lambda: e.stats.steps, delay=lambda s: 0
    )
    worker1, _ = make_offload_worker(e.vllm_config, stage1, cuda1)
    runner1 = FakeModelRunner(e.cfg, kv1, e.requests, cuda1.forward, e.block_sizes)
    stored: list[int] = []
    step = harness_engine.worker_step

    def both_stages(worker, runner, cuda, so, n, *args, **kwargs):
        so1 = copy.copy(so)
        so1.kv_connector_metadata = copy.deepcopy(so.kv_connector_metadata)
        stored.extend(getattr(so.kv_connector_metadata, "store_cpu_blocks", ()))
        out = step(worker, runner, cuda, so, n, *args, **kwargs)
        step(worker1, runner1, cuda1, so1, n, host_sync=kwargs.get("host_sync", True))
        return out

    monkeypatch.setattr(harness_engine, "worker_step", both_stages)
    return e, pool1, runner1, stored


def test_a_stage_with_more_layers_than_the_first(monkeypatch):
    vllm_config = make_vllm_config(cfg())
    counts = stage_pool_sizes(monkeypatch, vllm_config)
    assert counts == [C, C // 2], counts  # the budget over 1 and over 2 layers
    aligned = aligned_count(counts)
    e, pool1, runner1, stored = two_stage_engine(monkeypatch, aligned)
    assert pool1 == counts[1]
    scheduler = e.offload.num_cpu_blocks
    print(f"\nscheduler {scheduler} CPU blocks, workers {counts}, aligned {aligned}")
    for prompt in PROMPTS:  # 8 prompts of 4 blocks: 32 blocks to store
        e.add_request(prompt, max_tokens=4)
    if aligned is not None:
        assert aligned == scheduler == min(counts)
        e.run()
        print(f"stored to CPU ids up to {max(stored)}; no copy outside")
        assert max(stored) < pool1
        assert e.runner.violations == [] and runner1.violations == []
        return
    assert scheduler == C, "the scheduler sizes the pool from stage 0's layers"
    with pytest.raises(AssertionError, match="in neither KV cache") as info:
        e.run()
    print(f"stage 1 copy outside its pool: {info.value}; ids up to {max(stored)}")
    assert max(stored) >= pool1


def test_an_explicit_pool_size_every_stage_must_hold(monkeypatch):
    """0.33.0's num_cpu_blocks (kv_connector_extra_config): both sides use
    it, and a worker whose budget cannot hold it refuses at start-up. Where
    the connector reads no such key, each side keeps its own sizing."""
    vllm_config = make_vllm_config(cfg())
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["num_cpu_blocks"] = C // 2 + 4  # more than stage 1's budget holds
    if "num_cpu_blocks" not in inspect.getsource(SimpleCPUOffloadConnector.__init__):
        counts = stage_pool_sizes(monkeypatch, vllm_config)
        assert counts == [C, C // 2], "the key is ignored"
        return
    assert worker_pool_size(monkeypatch, vllm_config, stage_config(1)) == C // 2 + 4
    with pytest.raises(ValueError, match="local offload capacity 16"):
        worker_pool_size(monkeypatch, vllm_config, stage_config(2))
    extra["num_cpu_blocks"] = C // 2
    counts = stage_pool_sizes(monkeypatch, vllm_config)
    assert counts == [C // 2, C // 2]
