"""Drive vLLM's real Scheduler, KVCacheManager and SimpleCPUOffload on a CPU.

Real: Scheduler (with its KVCacheManager, coordinator and BlockPool), the
SimpleCPUOffloadConnector's scheduler side, and its worker side
(SimpleCPUOffloadWorker). Fake, because they need a GPU:

- the model runner (FakeModelRunner): keeps block tables from the
  scheduler's output as a real runner does, zeroes the new blocks the
  scheduler names (a Mamba hybrid's) and applies its copies, "computes" KV
  by writing a content tag into every block it fills (a Mamba group: the
  state there), checks the tag of every block it attends to (a Mamba
  group: the state it starts from), and samples one token per finished
  prefill/decode step;
- the CUDA pieces (harness.fake_cuda): streams, events and the driver's
  batch memcpy, ordered as a GPU orders them, with a checker that reports
  any two accesses of a block that nothing orders. The forward is one
  operation on the compute stream; the release's own DmaCopyBackend copies
  content tags between the fake GPU and CPU caches on its copy streams, and
  each transfer completes when the test says (at once, or some steps late).

With `async_scheduling` the engine runs as vLLM's EngineCore does with a
batch queue of two: step N+1 is scheduled and launched before step N's
output is processed, so output placeholders are live, and the host learns
step N's compute done only when it reads step N's sampled tokens. With
`pipeline_parallel_size` > 1 it keeps one step in flight per stage, as
EngineCore does for pipeline parallelism.

The worker is driven as each release's model runner drives its connector
(KVConnectorModelRunnerMixin): handle_preemptions, bind, start_load_kv,
forward, wait_for_save, get_finished, build_connector_worker_meta, clear.
Releases differ in which of these launch the copies (up to 0.28
get_finished launches both; from 0.29 start_load_kv loads and wait_for_save
stores), so all of them are called, except wait_for_save in a step that
schedules nothing where the release's kv_connector_no_forward skips it
(up to 0.30).

A content tag names the exact tokens a block holds (the chain of token
blocks before it, and its own tokens, counted in its group's block size),
computed from the request's tokens and independent of vLLM's block hashes.
A block that is lost, stale or misplaced is therefore caught by value when
it is read, not by counting.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker
from vllm.v1.structured_output import StructuredOutputManager

from harness import end_state, queue_state, reservation_check
from harness.fake_cuda import CopyEngine, FakeCuda

MODEL_DIR = Path(__file__).parent / "model"
NUM_KV_HEADS = 1
HEAD_SIZE = 16
DTYPE = torch.float16
# Bytes one block of one layer takes (K and V): the KV cache page size.
PAGE_BYTES = 2 * NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize
NULL_BLOCK_ID = 0

init_none_hash(sha256)


@dataclass
class HarnessConfig:
    # The smallest group's block size: vLLM's cache_config.block_size, which
    # EngineCore sets to the smallest group's, and the hash block size.
    block_size: int = 16
    num_gpu_blocks: int = 64
    num_cpu_blocks: int = 64
    # Full attention only, or full attention + sliding window (hybrid).
    hybrid: bool = False
    sliding_window: int = 64
    # The full-attention group's and the sliding-window group's block sizes,
    # as multiples of block_size (one of them 1). vLLM gives groups different
    # block sizes when their layers' KV per token differs: it grows a
    # group's block until every group's page has one size, so here a group
    # with a multiple m has heads m times smaller. The hybrid coordinator
    # then hashes at the smallest size and checks hits at the largest.
    full_block_multiple: int = 1
    swa_block_multiple: int = 1
    # A Mamba group after the attention groups, in this prefix-caching mode
    # of vLLM's (mamba_cache_mode): "align" (the state is kept at the end of
    # each step, in the block of its last token, and prefill chunks end on
    # block boundaries, where it is cached) or "all" (up to 0.31: the state
    # at every block boundary is kept). A model with Mamba layers has the
    # worker zero the new blocks the scheduler names (new_block_ids_to_zero),
    # which the fake runner does on the compute stream before the step's
    # loads are launched, as vLLM's does.
    mamba: str | None = None
    # The Mamba group's block size as a multiple of block_size (vLLM's
    # mamba_block_size may differ from the attention block size), and
    # whether it is the first group (a model whose first layer is a Mamba
    # layer): groups allocate in order, so an allocation refused in the
    # attention group comes after the Mamba group's.
    mamba_block_multiple: int = 1
    mamba_first: bool = False
    # Hash (prefix-match) every this many tokens, finer than the blocks
    # (vLLM's prefix_match_unit, which releases from 0.28.0 take): with a
    # Mamba "align" group, from 0.33.0 a prefix hit may then end inside a
    # block, which the allocation copies on write. None: the block size.
    prefix_match_unit: int | None = None
    offload: bool = True
    lazy: bool = False
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 16
    prefix_caching: bool = True
    # "fcfs" or "priority" (requests then carry a priority, lower first).
    policy: str = "fcfs"
    # What the scheduler does with a KV load that failed ("fail": the
    # request fails; "recompute": it is scheduled again). None: the default.
    kv_load_failure_policy: str | None = None
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Tokens one prefill chunk may take at most (0: the whole step budget),
    # so that a prefill can leave budget for other admissions in its step.
    long_prefill_token_threshold: int = 0
    # Admit a new request only if its whole prompt fits what is free (the
    # default); False checks only its first chunk, so an admission count can
    # meet the pool's edge mid-prompt.
    reserve_full_isl: bool = True
    # The scheduler's stats (events, prefix cache stats), as --disable-log-stats
    # off gives them.
    log_stats: bool = False
    # Schedule step N+1 before step N's output is processed (vLLM's
    # --async-scheduling: AsyncScheduler and a batch queue of two).
    async_scheduling: bool = False
    # Pipeline stages, as the scheduler sees them: EngineCore keeps this
    # many steps in flight (its batch queue), and without async scheduling
    # a request is scheduled again only once its step's output is back.
    # The fake runner still runs each step as one forward.
    pipeline_parallel_size: int = 1
    # Steps after launch at which a transfer completes (0: in the same step).
    transfer_delay: Callable[[bool], int] = field(default=lambda is_store: 0)
    # Compare every reservation the scheduler reads for an async load with a
    # recount (harness.reservation_check); off only where the recount's
    # cost would distort a timing (make bench).
    check_reservations: bool = True
    # Check the scheduler's queues around every step (harness.queue_state);
    # off only where the walk's cost would distort a timing (make bench).
    check_queues: bool = True

    def group_kinds(self) -> list[str]:
        """Each KV cache group's kind, in group order: full, then swa, then
        mamba (or mamba first)."""
        kinds = ["full"] + ["swa"] * self.hybrid
        if self.mamba:
            kinds.insert(0 if self.mamba_first else len(kinds), "mamba")
        return kinds

    def group_block_sizes(self) -> list[int]:
        """Each KV cache group's block size, in group order."""
        multiples = {
            "full": self.full_block_multiple,
            "swa": self.swa_block_multiple,
            "mamba": self.mamba_block_multiple,
        }
        return [self.block_size * multiples[k] for k in self.group_kinds()]


def make_vllm_config(cfg: HarnessConfig) -> VllmConfig:
    kv_transfer = None
    if cfg.offload:
        # The scheduler side makes (bytes / page size) CPU blocks: the groups
        # share one tensor, so a block's page is PAGE_BYTES * block_size.
        kv_transfer = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": cfg.num_cpu_blocks * PAGE_BYTES * cfg.block_size,
                "lazy_offload": cfg.lazy,
            },
            **(
                {"kv_load_failure_policy": cfg.kv_load_failure_policy}
                if cfg.kv_load_failure_policy
                else {}
            ),
        )
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(MODEL_DIR),
            dtype="float16",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=cfg.max_model_len,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.policy,
            async_scheduling=cfg.async_scheduling,
            is_encoder_decoder=False,
            **scheduler_options(cfg),
        ),
        cache_config=CacheConfig(
            block_size=cfg.block_size,
            enable_prefix_caching=cfg.prefix_caching,
            gpu_memory_utilization=0.9,
            # The scheduler reads the mode (align: prefill chunks end on
            # block boundaries, where the state is cached).
            **({"mamba_cache_mode": cfg.mamba} if cfg.mamba else {}),
            **(
                {"prefix_match_unit": cfg.prefix_match_unit}
                if cfg.prefix_match_unit
                else {}
            ),
        ),
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig("cpu"),
    )
    # The CPU platform turns async scheduling off; a GPU leaves it as asked,
    # and the scheduler reads it (e.g. to defer freeing blocks a step in
    # flight still uses).
    config.scheduler_config.async_scheduling = cfg.async_scheduling
    # Set after the config is built: its checks want a distributed executor
    # for more than one stage, which the scheduler never uses.
    config.parallel_config.pipeline_parallel_size = cfg.pipeline_parallel_size
    return config


def scheduler_options(cfg: HarnessConfig) -> dict[str, Any]:
    """SchedulerConfig options the harness sets, given only where a
    HarnessConfig differs from its own defaults (vLLM's too, on every
    release from 0.19.0 to 0.33.0)."""
    if cfg.reserve_full_isl:
        return {}
    return {"scheduler_reserve_full_isl": False}


def shared_tensor(size: int, layers: list[str], page: int) -> KVCacheTensor:
    """One KV cache tensor that every layer uses whole (the groups overlay).

    Up to 0.24 that is `shared_by=layers`; from 0.30 a tensor places its
    layers explicitly, and a layer stride of 0 puts them all on the same
    bytes, which is what shared_by meant."""
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in fields:
        return KVCacheTensor(size=size, shared_by=layers)
    return KVCacheTensor(size=size, layers=layers, layer_stride=0, block_stride=page)


def make_kv_cache_config(cfg: HarnessConfig) -> KVCacheConfig:
    """One full-attention group, plus a sliding-window group when hybrid
    and a Mamba group when asked.

    As in vLLM's hybrid layout, the groups share one KV cache tensor and
    one block pool: each block id belongs to one group at a time, and every
    group's page (a block of one layer) has one size, however many tokens
    its block holds.
    """
    sizes = cfg.group_block_sizes()
    if min(sizes) != cfg.block_size:
        raise ValueError(f"group block sizes {sizes}: the smallest must be block_size")
    page = PAGE_BYTES * cfg.block_size
    groups = []
    for kind, size in zip(cfg.group_kinds(), sizes, strict=True):
        groups.append(KVCacheGroupSpec([f"{kind}.0"], group_spec(cfg, kind, size)))
        assert groups[-1].kv_cache_spec.page_size_bytes == page
    layers = [name for g in groups for name in g.layer_names]
    return KVCacheConfig(
        num_blocks=cfg.num_gpu_blocks,
        kv_cache_tensors=[shared_tensor(page * cfg.num_gpu_blocks, layers, page)],
        kv_cache_groups=groups,
    )


def group_spec(cfg: HarnessConfig, kind: str, size: int) -> Any:
    """The spec of a group of `kind` whose blocks hold `size` tokens, its
    page PAGE_BYTES * cfg.block_size bytes."""
    if kind == "mamba":
        # One state tensor filling the page.
        page = PAGE_BYTES * cfg.block_size
        return MambaSpec(
            block_size=size,
            shapes=((page // DTYPE.itemsize,),),
            dtypes=(DTYPE,),
            mamba_cache_mode=cfg.mamba,
        )
    multiple = size // cfg.block_size
    if HEAD_SIZE % multiple:
        raise ValueError(f"block size multiple {multiple} must divide {HEAD_SIZE}")
    # Heads as much smaller as the block is larger: the page stays one size.
    attention = {"num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE // multiple}
    if kind == "swa":
        return SlidingWindowSpec(
            block_size=size, dtype=DTYPE, sliding_window=cfg.sliding_window, **attention
        )
    return FullAttentionSpec(block_size=size, dtype=DTYPE, **attention)


def scheduler_block_sizes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, int]:
    """(scheduler block size, hash block size) as the release's EngineCore
    gives them to its Scheduler. From 0.20.0 resolve_kv_cache_block_sizes
    does it (with groups of different sizes: their LCM and GCD); up to
    0.19.1 both are cache_config.block_size, the smallest group's."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:
        size = vllm_config.cache_config.block_size
        return size, size
    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def unsupported_layout(cfg: HarnessConfig) -> str | None:
    """Why the running release cannot run this layout, or None: its
    hybrid coordinator needs every group's block size to be a multiple of
    the hash block size, and up to 0.27 a Mamba group whose block size is
    not the cache's makes the release hash at the scheduler block size."""
    sizes = cfg.group_block_sizes()
    _, hash_size = scheduler_block_sizes(
        make_vllm_config(cfg), make_kv_cache_config(cfg)
    )
    if any(size % hash_size for size in sizes):
        return (
            f"this release hashes every {hash_size} tokens, and not every "
            f"group's block size ({sizes}) is a multiple of that"
        )
    return None


def sampled_token(req_id: str, position: int) -> int:
    """The token the fake runner samples for `req_id` at `position`: a
    function of both alone, so the runner knows the tokens of steps whose
    output the scheduler has not processed yet (its placeholders), as a
    real runner keeps them on the GPU."""
    return hash((req_id, position)) % 1000 + 3


def token_ids(req: Request, upto: int) -> list[int]:
    """The request's first `upto` tokens: the scheduler's, then the ones
    the runner sampled that the scheduler has not yet seen."""
    tokens = list(req.all_token_ids[:upto])
    tokens += (sampled_token(req.request_id, i) for i in range(len(tokens), upto))
    return tokens


class ContentOracle:
    """The content tag each block of a request must hold."""

    def __init__(self, block_sizes: int | Sequence[int]):
        """`block_sizes`: each group's block size, or one for every group."""
        self.block_sizes = block_sizes
        # (request, block size) -> the chain of its full blocks' tags.
        self._chains: dict[tuple[str, int], list[int]] = {}

    def block_size(self, group: int) -> int:
        sizes = self.block_sizes
        return sizes if isinstance(sizes, int) else sizes[group]

    def _chain(self, req: Request, bs: int, upto: int) -> list[int]:
        chain = self._chains.setdefault((req.request_id, bs), [])
        if len(chain) < upto:
            tokens = token_ids(req, upto * bs)
        while len(chain) < upto:
            i = len(chain)
            prev = chain[-1] if chain else 0
            chain.append(hash((prev, tuple(tokens[i * bs : (i + 1) * bs]))))
        return chain

    def tag(self, req: Request, group: int, index: int, num_tokens: int) -> tuple:
        """Tag of block `index` of `req` in `group` holding `num_tokens`
        (blocks are counted in the group's own block size)."""
        bs = self.block_size(group)
        if num_tokens == bs:
            return ("full", group, self._chain(req, bs, index + 1)[index])
        prev = self._chain(req, bs, index)[index - 1] if index else 0
        start = index * bs
        return (
            "part",
            group,
            prev,
            tuple(token_ids(req, start + num_tokens)[start:]),
        )

    def forget(self, req_id: str) -> None:
        for key in [k for k in self._chains if k[0] == req_id]:
            del self._chains[key]


# What a block holds once the worker zeroed it.
ZEROED = ("zeroed",)


@dataclass
class FakeKV:
    """The fake GPU and CPU KV caches: block id -> content tag."""

    gpu: dict[int, Any] = field(default_factory=dict)
    cpu: dict[int, Any] = field(default_factory=dict)


@dataclass
class Violation:
    step: int
    req_id: str
    group: int
    index: int
    block_id: int
    expected: Any
    got: Any

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.req_id} group {self.group} block "
            f"#{self.index} (id {self.block_id}) holds {self.got!r}, "
            f"expected {self.expected!r}"
        )


class FakeModelRunner:
    """Block tables from the scheduler output; KV as content tags."""

    def __init__(
        self,
        cfg: HarnessConfig,
        kv: FakeKV,
        requests: dict[str, Request],
        forward: Callable[[str, list[int], dict[int, Any]], Any],
    ):
        """`forward(name, reads, writes)` launches the forward on the compute
        stream: it reads the blocks `reads` and writes `writes` (block id ->
        KV tag)."""
        self.cfg, self.kv, self.requests = cfg, kv, requests
        self.forward = forward
        self.block_sizes = cfg.group_block_sizes()
        self.kinds = cfg.group_kinds()
        self.oracle = ContentOracle(self.block_sizes)
        self.tables: dict[str, list[list[int]]] = {}
        self.violations: list[Violation] = []
        self.num_groups = len(self.block_sizes)

    def _update_tables(self, so: SchedulerOutput) -> dict[str, int]:
        computed: dict[str, int] = {}
        for req_id in so.preempted_req_ids or ():
            self.tables.pop(req_id, None)
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
            self.oracle.forget(req_id)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                self.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    self.tables[req_id][g].extend(ids)
            computed[req_id] = cached.num_computed_tokens[i]
        return computed

    def _needed(self, group: int, computed: int) -> range:
        """Block indices a step starting at `computed` attends to (a Mamba
        group: the block holding the state after `computed` tokens)."""
        bs = self.block_sizes[group]
        kind = self.kinds[group]
        if kind == "mamba":
            if computed == 0:
                return range(0)
            return range((computed - 1) // bs, (computed - 1) // bs + 1)
        first = 0
        if kind == "swa":
            first = max(0, computed - (self.cfg.sliding_window - 1)) // bs
        return range(first, (computed + bs - 1) // bs)

    def prepare(self, so: SchedulerOutput, step: int) -> None:
        """What the runner does on the compute stream before the step's
        connector calls (its _update_states): zero the new blocks the
        scheduler names, then make the copies it asks for (copy on write of
        a block a prefix hit ends inside, from 0.33)."""
        zero = getattr(so, "new_block_ids_to_zero", None) or []
        if zero:
            self.forward(f"the zeroing of step {step}", [], dict.fromkeys(zero, ZEROED))
        for copy in getattr(so, "kv_cache_block_copies", None) or []:
            src, dst = copy.src_block_id, copy.dst_block_id
            self.forward(
                f"a block copy of step {step}", [src], {dst: self.kv.gpu.get(src)}
            )

    def execute(self, so: SchedulerOutput, step: int) -> ModelRunnerOutput:
        computed = self._update_tables(so)
        req_ids, sampled = [], []
        reads: list[int] = []
        writes: dict[int, Any] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            c = computed[req_id]
            table = self.tables[req_id]
            for g, bs in enumerate(self.block_sizes):
                for i in self._needed(g, c):
                    bid = table[g][i]
                    want = self.oracle.tag(req, g, i, min(bs, c - i * bs))
                    got = None
                    if bid != NULL_BLOCK_ID:
                        reads.append(bid)
                        # What an earlier request of this step wrote, or the
                        # cache's KV.
                        got = writes.get(bid, self.kv.gpu.get(bid))
                    if got != want:
                        self.violations.append(
                            Violation(step, req_id, g, i, bid, want, got)
                        )
                # The blocks the tokens fall in. In a Mamba group block i
                # gets the state after its last token (the tag of the tokens
                # up to there): align mode's table has null blocks but the
                # one of the step's last token, "all" mode's none.
                for i in range(c // bs, (c + n - 1) // bs + 1):
                    bid = table[g][i]
                    if bid != NULL_BLOCK_ID:
                        writes[bid] = self.oracle.tag(
                            req, g, i, min(bs, c + n - i * bs)
                        )
            req_ids.append(req_id)
            done_prefill = c + n >= req.num_tokens
            sampled.append([sampled_token(req_id, c + n)] if done_prefill else [])
        self.forward(f"the forward of step {step}", reads, writes)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


def make_offload_worker(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cuda: FakeCuda
) -> tuple[SimpleCPUOffloadWorker, CopyEngine]:
    """The release's real offload worker, copying on the fake CUDA."""
    worker = SimpleCPUOffloadWorker(vllm_config, kv_cache_config, cpu_capacity_bytes=0)
    backend = CopyEngine(cuda)
    # In place of register_kv_caches, which needs CUDA tensors: the copy
    # backend, and the worker's own copy streams (left None, an event the
    # worker records on one of them would land on the compute stream).
    worker._backend = backend  # type: ignore[assignment]
    worker.load_stream = cuda.load  # type: ignore[assignment]
    worker.store_stream = cuda.store  # type: ignore[assignment]
    return worker, backend


def _no_forward_skips_save() -> bool:
    """Whether this release's runner skips the connector's wait_for_save in
    a step that schedules nothing (kv_connector_no_forward)."""
    from vllm.v1.worker.kv_connector_model_runner_mixin import (
        KVConnectorModelRunnerMixin,
    )

    no_forward = KVConnectorModelRunnerMixin.kv_connector_no_forward
    return "wait_for_save=False" in inspect.getsource(no_forward)


NO_FORWARD_SKIPS_SAVE = _no_forward_skips_save()


def worker_step(
    worker: SimpleCPUOffloadWorker | None,
    runner: FakeModelRunner,
    cuda: FakeCuda,
    so: SchedulerOutput,
    step: int,
    failed_loads: Callable[[set[str] | None], set[int]] = lambda recving: set(),
    host_sync: bool = True,
) -> ModelRunnerOutput:
    """The worker side of one step, in the model runner's order: the
    connector's calls around the forward, as each release's runner makes
    them. `failed_loads(recving)` names the blocks whose load failed.
    `host_sync`: the host reads the step's sampled tokens before it returns
    (synchronous scheduling); otherwise the caller syncs later."""
    if worker is None:
        runner.prepare(so, step)
        out = runner.execute(so, step)
    else:
        with cuda.active():
            worker.handle_preemptions(so.kv_connector_metadata)
            runner.prepare(so, step)
            worker.bind_connector_metadata(so.kv_connector_metadata)
            # Up to 0.29 the runner starts loads before the forward; from
            # 0.30 only a step with sync loads (which feed its forward) does,
            # and others start them after the forward is launched.
            before = getattr(so, "has_sync_kv_loads", True)
            if before:
                worker.start_load_kv()
            out = runner.execute(so, step)
            if not before:
                worker.start_load_kv()
            # A step that schedules nothing runs no forward: the runner's
            # kv_connector_no_forward, which up to 0.30 skips wait_for_save
            # (where 0.29-0.30's worker launches stores).
            if so.total_num_scheduled_tokens > 0 or not NO_FORWARD_SKIPS_SAVE:
                worker.wait_for_save()
            sending, recving = worker.get_finished(so.finished_req_ids)
            invalid = failed_loads(recving)
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
                # Passed only when set: not every release has the field.
                **({"invalid_block_ids": invalid} if invalid else {}),
            )
            worker.clear_connector_metadata()
    if host_sync:
        cuda.host_sync()
    return out


@dataclass
class StepStats:
    steps: int = 0
    # Tokens the scheduler gave work to: the unit a speed comparison divides
    # by, so a series that schedules more or less work is not read as slower.
    scheduled_tokens: int = 0
    preemptions: int = 0
    # Time spent in vLLM's Scheduler (schedule + update_from_output), not in
    # the fake runner and worker: what a speed comparison should look at.
    scheduler_seconds: float = 0.0
    finished: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)


class Engine:
    """A scheduler step loop with the fake runner and the real offload worker."""

    def __init__(self, cfg: HarnessConfig | None = None):
        self.cfg = cfg or HarnessConfig()
        self.vllm_config = make_vllm_config(self.cfg)
        self.vllm_config.cache_config.num_gpu_blocks = self.cfg.num_gpu_blocks
        self.kv_cache_config = make_kv_cache_config(self.cfg)
        scheduler_class = AsyncScheduler if self.cfg.async_scheduling else Scheduler
        block_size, self.hash_block_size = scheduler_block_sizes(
            self.vllm_config, self.kv_cache_config
        )
        # Up to 0.19.1 the Scheduler hashes at its own block size.
        params = inspect.signature(Scheduler.__init__).parameters
        hashing = (
            {"hash_block_size": self.hash_block_size}
            if "hash_block_size" in params
            else {}
        )
        self.scheduler = scheduler_class(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=self.cfg.log_stats,
            **hashing,
        )
        self.kv = FakeKV()
        self.stats = StepStats()
        self.requests: dict[str, Request] = {}
        self.block_hasher = get_request_block_hasher(self.hash_block_size, sha256)
        self.cuda = FakeCuda(
            self.kv.gpu,
            self.kv.cpu,
            self.cfg.num_gpu_blocks,
            self.cfg.num_cpu_blocks,
            clock=lambda: self.stats.steps,
            delay=self.cfg.transfer_delay,
        )
        self.runner = FakeModelRunner(
            self.cfg, self.kv, self.requests, self.cuda.forward
        )
        # Async scheduling: steps launched whose output is not processed
        # yet, oldest first, each with where the compute stream was after it.
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput, Any]] = deque()
        self.copy_backend: CopyEngine | None = None
        self.worker: SimpleCPUOffloadWorker | None = None
        if self.cfg.offload:
            self.worker, self.copy_backend = make_offload_worker(
                self.vllm_config, self.kv_cache_config, self.cuda
            )
        self._ids = itertools.count()
        # Requests whose next CPU->GPU load fails, each with how many of its
        # first blocks stay valid (see fail_next_load).
        self._failing_loads: dict[str, int] = {}
        self._guard_block_counts()
        if self.cfg.check_reservations:
            reservation_check.install(self.scheduler)
        # Queue violations found by step(), each with the step it was found
        # at. A test wants the first to fail it where it happened; a trace or
        # soak worker records them instead (raise_queue_violations False).
        self.queue_violations: list[str] = []
        self.raise_queue_violations = True

    def _guard_block_counts(self) -> None:
        """Fail at once when the GPU pool is asked for more blocks than it
        has free while no peer shares it: the scheduler counts before it
        allocates, so only a wrong count gets there. 0002 turns that refusal
        into a preemption, which would hide the wrong count; a PeerEngine
        (installed over this guard) makes refusals expected."""
        pool = self.block_pool
        get_new_blocks = pool.get_new_blocks

        def counted_get_new_blocks(num_blocks: int) -> list[Any]:
            shared = pool.get_new_blocks is not counted_get_new_blocks
            if not shared and num_blocks > pool.get_num_free_blocks():
                raise AssertionError(
                    f"asked the unshared GPU pool for {num_blocks} blocks with "
                    f"{pool.get_num_free_blocks()} free: a block count is wrong"
                )
            return get_new_blocks(num_blocks)

        pool.get_new_blocks = counted_get_new_blocks

    # --- handles on the real objects -------------------------------------
    @property
    def block_pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def offload(self):
        """The connector's scheduler-side SimpleCPUOffloadScheduler."""
        connector = self.scheduler.connector
        return connector.scheduler_manager if connector is not None else None

    # --- requests ---------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        max_tokens: int = 1,
        req_id: str | None = None,
        resumable: bool = False,
        priority: int = 0,
        stop_at: int | None = None,
    ) -> str:
        """Add a request. `resumable` makes a streaming-input session: it
        waits for its next chunk, keeping its KV, when it stops; a later call
        with the same `req_id` sends that chunk, as the engine does.
        `stop_at`: the request stops on the token it samples at this
        position (a stop token: under async scheduling its next step is
        already launched when the scheduler learns it is done)."""
        req_id = req_id or f"r{next(self._ids)}"
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                stop_token_ids=[sampled_token(req_id, stop_at)] if stop_at else None,
            ),
            pooling_params=None,
            block_hasher=self.block_hasher,
            priority=priority,
            # Passed only when set: releases before streaming input lack it.
            **({"resumable": True} if resumable else {}),
        )
        # A session's next chunk updates the request already there.
        self.requests.setdefault(req_id, req)
        self.scheduler.add_request(req)
        return req_id

    def fail_next_load(self, req_id: str, valid_blocks: int = 0) -> None:
        """The next load of `req_id` fails: when it completes, the worker
        reports the request's blocks from its `valid_blocks`-th on as
        invalid (as a connector does through get_block_ids_with_load_errors)
        and the fake GPU cache loses what the copy wrote there.

        0 (the default): the load fails whole, every block the request holds
        is invalid. More: it fails in part, its first `valid_blocks` blocks
        (prefix hits and loaded blocks alike) keep what they hold, and the
        scheduler keeps them: it truncates the request's computed tokens to
        the first invalid block and prefills the rest. Counted in each KV
        cache group's own blocks (the releases refuse block-level failures
        with more than one group, or read them per group)."""
        self._failing_loads[req_id] = valid_blocks

    def _failed_load_blocks(self, recving: set[str] | None) -> set[int]:
        invalid: set[int] = set()
        for req_id in sorted(self._failing_loads.keys() & set(recving or ())):
            valid_blocks = self._failing_loads.pop(req_id)
            for ids in self.scheduler.kv_cache_manager.get_block_ids(req_id):
                for block_id in ids[valid_blocks:]:
                    invalid.add(block_id)
                    self.kv.gpu.pop(block_id, None)
        return invalid

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.stats.aborted.add(req_id)

    # --- stepping -----------------------------------------------------------
    def step(self) -> SchedulerOutput | None:
        """One engine step (see _step), with the scheduler's queues checked
        before it (what add_request and abort did since the last step) and
        after it."""
        queue_state.check_step(self, "before")
        so = self._step()
        queue_state.check_step(self, "after")
        return so

    def _step(self) -> SchedulerOutput | None:
        """One engine step. Synchronous: schedule, run, process the output.
        With async scheduling or pipeline stages, as
        EngineCore.step_with_batch_queue: schedule and launch a step (when
        there are requests), and process the oldest step's output once the
        batch queue is full (two steps, or one per stage) or nothing new was
        scheduled. Returns the step scheduled, if any."""
        stages = self.cfg.pipeline_parallel_size
        if not self.cfg.async_scheduling and stages == 1:
            so, out = self._launch(host_sync=True)
            self._process(so, out)
            return so
        so = None
        if self.scheduler.has_requests() or not self.in_flight:
            so, out = self._launch(host_sync=False)
            self.in_flight.append((so, out, self.cuda.compute_mark()))
            depth = stages if stages > 1 else 2
            if so.total_num_scheduled_tokens > 0 and len(self.in_flight) < depth:
                return so
        old, out, mark = self.in_flight.popleft()
        # The host reads that step's sampled tokens: its forward is done.
        self.cuda.host_sync(mark)
        self._process(old, out)
        return so

    def _launch(self, host_sync: bool) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        start = time.perf_counter()
        so = self.scheduler.schedule()
        self.stats.scheduler_seconds += time.perf_counter() - start
        self.stats.preemptions += len(so.preempted_req_ids or ())
        self.stats.scheduled_tokens += so.total_num_scheduled_tokens
        out = worker_step(
            self.worker,
            self.runner,
            self.cuda,
            so,
            self.stats.steps,
            self._failed_load_blocks,
            host_sync=host_sync,
        )
        self.stats.steps += 1
        return so, out

    def _process(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        start = time.perf_counter()
        engine_outputs = self.scheduler.update_from_output(so, out)
        self.stats.scheduler_seconds += time.perf_counter() - start
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.stats.finished.add(o.request_id)

    def busy(self) -> bool:
        """Requests in flight, steps whose output is not processed, or
        offload transfers not yet completed."""
        if self.scheduler.has_requests() or self.in_flight:
            return True
        off = self.offload
        return off is not None and bool(off._store_event_to_blocks or off._reqs_to_load)

    def run(
        self,
        max_steps: int = 10_000,
        after_step: Callable[[Engine], None] | None = None,
    ) -> int:
        """Step until everything finished and every transfer completed."""
        start = self.stats.steps
        while self.busy():
            if self.stats.steps - start >= max_steps:
                raise AssertionError(
                    f"not done after {max_steps} steps: "
                    f"{len(self.scheduler.running)} running, "
                    f"{self.scheduler.get_request_counts()[1]} waiting"
                )
            self.step()
            if after_step is not None:
                after_step(self)
        if not self.scheduler.requests:
            problems = end_state.end_state_violations(self)
            assert not problems, "left behind after the run:\n  " + "\n  ".join(
                problems
            )
        return self.stats.steps - start
