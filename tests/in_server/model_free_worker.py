# SPDX-License-Identifier: Apache-2.0
"""A vLLM worker with no model, for `vllm serve --worker-cls` on a CPU.

It runs the harness's worker side inside the real engine: the fake model
runner (content tags, one sampled token per finished step) and the
release's real SimpleCPUOffloadWorker copying on the fake CUDA, driven in
the model runner's order (harness.runner.worker_step). Everything above it
is the real server: the OpenAI API server, EngineCore, the Scheduler, the
KV cache manager and the connector's scheduler side.

KV cache specs: one full-attention layer, plus one sliding-window layer
when VLLM_FORK_E2E_HYBRID=1 (serve with --no-disable-hybrid-kv-cache-manager:
with a KV connector vLLM turns the hybrid manager off unless asked). The
pool's size is --num-gpu-blocks-override. Stores complete
VLLM_FORK_E2E_STORE_DELAY worker steps after launch.

Every content-tag violation (a block read that does not hold what the
request's tokens say) is appended to the JSON-lines file named by
VLLM_FORK_E2E_VIOLATIONS as it is found, for the client to read (without
it, to the server's log as an error).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from harness.config import DTYPE, HEAD_SIZE, NUM_KV_HEADS, HarnessConfig
from harness.fake_cuda import FakeCuda
from harness.runner import FakeKV, FakeModelRunner, make_offload_worker, worker_step

logger = logging.getLogger(__name__)
HYBRID = os.environ.get("VLLM_FORK_E2E_HYBRID") == "1"
SLIDING_WINDOW = int(os.environ.get("VLLM_FORK_E2E_SLIDING_WINDOW", "64"))
# Worker steps after launch at which a GPU->CPU store completes (loads
# complete in their own step): stores then outlive the requests they serve.
STORE_DELAY = int(os.environ.get("VLLM_FORK_E2E_STORE_DELAY", "0"))
# Pretend memory: far more than any pool here; --num-gpu-blocks-override
# sets the pool's real size.
AVAILABLE_BYTES = 1 << 30


@dataclass
class TokenRecord:
    """What a model runner keeps of a request: its prompt and the tokens it
    sampled (the scheduler sends a running request's tokens only once)."""

    request_id: str
    all_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def gpu_total_bytes(kv_cache_config: KVCacheConfig) -> int:
    """The GPU KV cache's size as the release's offload connector counts it:
    from 0.33 every tensor places layers in one allocation (so the first
    one's size); before, the scheduler side summed the tensors."""
    try:
        from vllm.v1.simple_kv_offload.sizing import gpu_total_bytes as release_own
    except ImportError:
        return sum(t.size for t in kv_cache_config.kv_cache_tensors)
    return release_own(kv_cache_config)


class ModelFreeWorker(WorkerBase):
    def init_device(self) -> None:
        self._pending: Any = None
        self._steps = 0
        self._reported = 0
        self.requests: dict[str, TokenRecord] = {}
        self.violations_path = os.environ.get("VLLM_FORK_E2E_VIOLATIONS")

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        bs = self.cache_config.block_size
        specs: dict[str, KVCacheSpec] = {
            "full.0": FullAttentionSpec(
                block_size=bs,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
            )
        }
        if HYBRID:
            specs["swa.0"] = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
                sliding_window=SLIDING_WINDOW,
            )
        return specs

    def determine_available_memory(self) -> int:
        return AVAILABLE_BYTES

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        # Up to some releases the executor passes one config per worker.
        if isinstance(kv_cache_config, list):
            kv_cache_config = kv_cache_config[self.rank]
        self._build(kv_cache_config)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        return

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def get_simple_cpu_offload_num_cpu_blocks(self) -> int | None:
        """From 0.33 the scheduler side sizes its CPU pool from the workers'."""
        return self.cfg.num_cpu_blocks if self.offload is not None else None

    def _build(self, kv_cache_config: KVCacheConfig) -> None:
        groups = [
            type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups
        ]
        # The fake runner reads group 0 as full attention, 1 as the window.
        want = ["FullAttentionSpec"] + (["SlidingWindowSpec"] if HYBRID else [])
        if groups != want:
            raise RuntimeError(f"KV cache groups {groups}, expected {want}")
        transfer = self.vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer else {}
        num_gpu_blocks = kv_cache_config.num_blocks
        num_cpu_blocks = 0
        if transfer is not None:
            if "cpu_bytes_to_use" not in extra:
                raise ValueError("the e2e servers give the connector cpu_bytes_to_use")
            # As the release sizes the CPU pool (one rank).
            cpu_bytes = int(extra["cpu_bytes_to_use"])
            gpu_bytes = gpu_total_bytes(kv_cache_config)
            num_cpu_blocks = max(1, num_gpu_blocks * cpu_bytes // gpu_bytes)
        self.cfg = HarnessConfig(
            block_size=self.cache_config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            hybrid=HYBRID,
            sliding_window=SLIDING_WINDOW,
            offload=transfer is not None,
            lazy=bool(extra.get("lazy_offload", False)),
        )
        self.kv = FakeKV()
        self.cuda = FakeCuda(
            self.kv.gpu,
            self.kv.cpu,
            num_gpu_blocks,
            num_cpu_blocks,
            clock=lambda: self._steps,
            delay=lambda is_store: STORE_DELAY if is_store else 0,
        )
        self.runner = FakeModelRunner(
            self.cfg,
            self.kv,
            self.requests,
            self.cuda.forward,
        )
        self.offload = None
        if transfer is not None:
            self.offload, _ = make_offload_worker(
                self.vllm_config, kv_cache_config, self.cuda
            )

    def execute_model(self, scheduler_output: Any) -> None:
        so = scheduler_output
        # Block copies (copy-on-write of a partial hit) and zeroing are work
        # this worker does not do: stop rather than report false violations.
        for unsupported in ("kv_cache_block_copies", "new_block_ids_to_zero"):
            if getattr(so, unsupported, None):
                raise NotImplementedError(f"the model-free worker got {unsupported}")
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # Model Runner V2 sends a resumed request as new, with all its
            # tokens in prefill_token_ids.
            tokens = new.prefill_token_ids or new.prompt_token_ids or []
            self.requests[new.req_id] = TokenRecord(new.req_id, list(tokens))
        try:
            out = worker_step(self.offload, self.runner, self.cuda, so, self._steps)
        finally:
            # Even when the step raised: what it read wrong is reported.
            self._report()
        self._steps += 1
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.requests[req_id].all_token_ids.extend(tokens)
        self._pending = out
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        out, self._pending = self._pending, None
        return out

    def _report(self) -> None:
        new = self.runner.violations[self._reported :]
        if not new:
            return
        self._reported += len(new)
        if not self.violations_path:
            # No file to read them from: the server's log has them.
            for v in new:
                logger.error("content violation: %s", v)
            return
        with open(self.violations_path, "a") as f:
            for v in new:
                f.write(json.dumps({"step": v.step, "violation": str(v)}) + "\n")

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        return
