"""The harness's configuration: HarnessConfig, and the vLLM config, KV cache
config and KV cache specs built from it for the real Scheduler, its
KVCacheManager and SimpleCPUOffload (harness.engine drives them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

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
    # Model align mode's state writes exactly: one state a step, after its
    # last token, into that token's block (a block a step starts inside
    # keeps the state it held). Off, the fake runner tags every block a
    # step's tokens fall in with the state at its end or the step's, which
    # hides a chunk that ends inside a block whose boundary is then cached
    # (ledger row eagle-mamba-align-split-state, PR vllm#51113: with EAGLE,
    # 0.19.0-0.26.0, base and series alike). Off by default until the
    # series carry that fix; tests/harness_tests/
    # test_mamba_align_split_state.py turns it on.
    mamba_align_state: bool = False
    # A ring-buffer group last (vLLM's CircularBufferSpec, from 0.29.0) of
    # block_size tokens a block, outside prefix caching, as a compressor's
    # state (DeepSeek-V4.1) or a QSA ring (Qwen4Exp) is: its blocks may be
    # smaller than the hash block, which only prefix-cacheable groups set.
    # The fake runner leaves it out of its content checks.
    ring: bool = False
    # Hash (prefix-match) every this many tokens, finer than the blocks
    # (vLLM's prefix_match_unit, which releases from 0.26.0 take): with a
    # Mamba "align" group, from 0.28.0 a prefix hit may then end inside a
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
    # Speculative decoding with this many draft tokens a step (vLLM's ngram
    # method, which needs no draft model). The scheduler pads a request
    # that resumes with one token to 1 + k (from 0.25) and, under async
    # scheduling, schedules k placeholder drafts for every decode. The fake
    # runner proposes no drafts and its one sampled token rejects every
    # draft it is given: each step's accepted count is 0.
    num_speculative_tokens: int = 0
    # Decode context parallelism, as the scheduler sees it: the release's
    # managers scale a group's block by this many ranks where its KV is
    # striped over them (full attention; from 0.29.0 a Mamba group keeps
    # its own size, and up to 0.28.0 its manager refuses DCP). The fake
    # runner models the ranks as one, holding each block whole (every rank
    # copies the same block ids); each rank's own CPU pool size and its
    # share of a transfer's completions are not modelled.
    decode_context_parallel_size: int = 1
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
        mamba (or mamba first), then ring."""
        kinds = ["full"] + ["swa"] * self.hybrid
        if self.mamba:
            kinds.insert(0 if self.mamba_first else len(kinds), "mamba")
        return kinds + ["ring"] * self.ring

    def group_block_sizes(self) -> list[int]:
        """Each KV cache group's block size, in group order."""
        multiples = {
            "full": self.full_block_multiple,
            "swa": self.swa_block_multiple,
            "mamba": self.mamba_block_multiple,
            "ring": 1,
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
    model_config = ModelConfig(
        model=str(MODEL_DIR),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
    )
    config = VllmConfig(
        model_config=model_config,
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
        speculative_config=speculative_config(cfg, model_config),
    )
    # The CPU platform turns async scheduling off; a GPU leaves it as asked,
    # and the scheduler reads it (e.g. to defer freeing blocks a step in
    # flight still uses).
    config.scheduler_config.async_scheduling = cfg.async_scheduling
    # Set after the config is built: its checks want a distributed executor
    # for more than one stage, which the scheduler never uses.
    config.parallel_config.pipeline_parallel_size = cfg.pipeline_parallel_size
    # So is DCP: its checks want as many tensor-parallel ranks.
    config.parallel_config.decode_context_parallel_size = (
        cfg.decode_context_parallel_size
    )
    return config


def speculative_config(
    cfg: HarnessConfig, model_config: ModelConfig
) -> SpeculativeConfig | None:
    """The ngram speculative config of cfg.num_speculative_tokens drafts a
    step, or None without speculative decoding."""
    if not cfg.num_speculative_tokens:
        return None
    return SpeculativeConfig(
        # ngram_gpu under async scheduling, which vLLM refuses with ngram:
        # the scheduler reads neither (no lookahead slots for either).
        method="ngram_gpu" if cfg.async_scheduling else "ngram",
        num_speculative_tokens=cfg.num_speculative_tokens,
        prompt_lookup_min=1,
        prompt_lookup_max=cfg.num_speculative_tokens,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )


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
    if kind == "ring":
        from vllm.v1 import kv_cache_interface

        if not hasattr(kv_cache_interface, "CircularBufferSpec"):
            raise ValueError("this release has no CircularBufferSpec (a ring group)")
        return kv_cache_interface.CircularBufferSpec(
            block_size=size, dtype=DTYPE, **attention
        )
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
