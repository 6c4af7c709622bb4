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

import inspect
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker
from vllm.v1.structured_output import StructuredOutputManager

from harness import end_state, queue_state, reservation_check, steps_in_flight
from harness.config import (
    HarnessConfig,
    make_kv_cache_config,
    make_vllm_config,
    scheduler_block_sizes,
)
from harness.fake_cuda import CopyEngine, FakeCuda
from harness.runner import (
    FakeKV,
    FakeModelRunner,
    make_offload_worker,
    sampled_token,
    worker_step,
)

__all__ = ["Engine", "HarnessConfig", "StepStats"]


def mm_feature(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    """A multimodal item of a prompt: what the block hasher keys a block on
    (its content hash and its placeholders' positions), with no encoder
    input behind it."""
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


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
    # Each finished request's reason, by name (STOP, LENGTH, ABORT, ERROR).
    finish_reasons: dict[str, str] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)

    @property
    def finished(self) -> set[str]:
        """The requests that finished, for whatever reason."""
        return set(self.finish_reasons)


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
        # The tokens a block of each group holds, as the scheduler's managers
        # count them: the specs' sizes, scaled where decode context
        # parallelism stripes a group over its ranks.
        self.block_sizes = [
            m.block_size
            for m in self.scheduler.kv_cache_manager.coordinator.single_type_managers
        ]
        if self.cfg.decode_context_parallel_size == 1:
            assert self.block_sizes == self.cfg.group_block_sizes(), (
                f"the managers' block sizes {self.block_sizes} are not the "
                f"specs' {self.cfg.group_block_sizes()}"
            )
        self.runner = FakeModelRunner(
            self.cfg, self.kv, self.requests, self.cuda.forward, self.block_sizes
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
        self._failing_loads: dict[str, int | None] = {}
        self._guard_block_counts()
        if self.cfg.check_reservations:
            reservation_check.install(self.scheduler)
        # Violations of the scheduler's bookkeeping found by step() (its
        # queues: harness.queue_state; each request's steps in flight:
        # harness.steps_in_flight), each with the step it was found at. A
        # test wants the first to fail it where it happened; a trace or soak
        # worker records them instead (raise_queue_violations False).
        self.queue_violations: list[str] = []
        # Requests a known upstream heap break left out of order
        # (harness.queue_state.mark_downstream).
        self.known_misplaced: set[str] = set()
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
        sampling: dict[str, Any] | None = None,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        embeds: tuple[Any, list[bool]] | None = None,
        mm: list[tuple[str, int, int]] | None = None,
    ) -> str:
        """Add a request. `resumable` makes a streaming-input session: it
        waits for its next chunk, keeping its KV, when it stops; a later call
        with the same `req_id` sends that chunk, as the engine does.
        `stop_at`: the request stops on the token it samples at this
        position (a stop token: under async scheduling its next step is
        already launched when the scheduler learns it is done).
        `sampling`: more SamplingParams (prompt_logprobs, for one, marks the
        request to skip reading the prefix cache). `lora`: the adapter's
        name and path (the fake model runs no adapter). `cache_salt`: the
        request's salt, which keys its first block apart. `embeds`: a
        mixed prompt (0.21.0 on), its embeddings tensor (one row a token)
        and its mask, True where the token id is the input, False where
        the tensor's row is (the fake model reads neither). `mm`: the
        prompt's multimodal items, each (its content hash, its first
        placeholder position in `prompt`, its placeholder count); the fake
        model runs no encoder, so the scheduler is given a budget for them."""
        req_id = req_id or f"r{next(self._ids)}"
        if mm:
            self._serve_encoder_inputs()
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                stop_token_ids=[sampled_token(req_id, stop_at)] if stop_at else None,
                **(sampling or {}),
            ),
            pooling_params=None,
            block_hasher=self.block_hasher,
            priority=priority,
            lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
            cache_salt=cache_salt,
            mm_features=[mm_feature(*item) for item in mm or ()] or None,
            # Passed only when set: releases before streaming input lack it,
            # and those before 0.21.0 mixed prompts.
            **({"resumable": True} if resumable else {}),
            **(
                {"prompt_embeds": embeds[0], "prompt_is_token_ids": embeds[1]}
                if embeds
                else {}
            ),
        )
        # A session's next chunk updates the request already there.
        self.requests.setdefault(req_id, req)
        self.scheduler.add_request(req)
        return req_id

    def _serve_encoder_inputs(self) -> None:
        """Give the scheduler an encoder budget and cache, as it has for a
        multimodal model: it sizes both from the model's processor, and the
        harness's model has none, so every item would wait for ever."""
        if self.scheduler.max_num_encoder_input_tokens == 0:
            size = self.vllm_config.scheduler_config.max_num_batched_tokens
            self.scheduler.max_num_encoder_input_tokens = size
            self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=size)

    def fail_next_load(
        self, req_id: str, valid_blocks: int = 0, by_request: bool = False
    ) -> None:
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
        with more than one group, or read them per group).

        `by_request`: the worker names the request instead of its blocks
        (KVConnectorOutput.failed_recving, 0.30.0 on, as Mooncake's connector
        reports a failed transfer), and the whole load is lost."""
        if (
            by_request
            and "failed_recving" not in KVConnectorOutput.__dataclass_fields__
        ):
            raise NotImplementedError(
                "this release's KVConnectorOutput has no failed_recving"
            )
        self._failing_loads[req_id] = None if by_request else valid_blocks

    def _failed_loads(self, recving: set[str] | None) -> tuple[set[int], set[str]]:
        """The blocks, and the requests, whose load failed this step."""
        invalid: set[int] = set()
        failed: set[str] = set()
        for req_id in sorted(self._failing_loads.keys() & set(recving or ())):
            valid_blocks = self._failing_loads.pop(req_id)
            if valid_blocks is None:
                # Failed by request: what the load wrote is lost. Its blocks
                # are the request's uncached ones (a loaded block is cached
                # once its load lands); its prefix hits keep what they hold.
                failed.add(req_id)
                blocks = self.scheduler.kv_cache_manager.get_blocks(req_id).blocks
                for group in blocks:
                    for block in group:
                        if block.block_hash is None and not block.is_null:
                            self.kv.gpu.pop(block.block_id, None)
                continue
            for ids in self.scheduler.kv_cache_manager.get_block_ids(req_id):
                for block_id in ids[valid_blocks:]:
                    invalid.add(block_id)
                    self.kv.gpu.pop(block_id, None)
        return invalid, failed

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.stats.aborted.add(req_id)

    # --- stepping -----------------------------------------------------------
    def preempt(self, req_id: str) -> None:
        """Preempt the running request `req_id` between two steps, as
        schedule() does when a running request cannot get blocks: out of
        the running queue, back to waiting with its blocks freed (cached
        where hashed), and not among the last step's scheduled requests, so
        the step that resumes it sends its tokens whole. Synchronous
        scheduling only: under async scheduling a step in flight would need
        reset_prefix_cache's handling of its output."""
        assert not self.cfg.async_scheduling, "preempt() is for sync scheduling"
        s = self.scheduler
        request = s.requests[req_id]
        s.running.remove(request)
        s._preempt_request(request, time.monotonic())
        s.prev_step_scheduled_req_ids.discard(req_id)

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
        steps_in_flight.check(self, so)
        self.stats.preemptions += len(so.preempted_req_ids or ())
        self.stats.scheduled_tokens += so.total_num_scheduled_tokens
        out = worker_step(
            self.worker,
            self.runner,
            self.cuda,
            so,
            self.stats.steps,
            self._failed_loads,
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
                    self.stats.finish_reasons[o.request_id] = o.finish_reason.name

    def step_until_waiting_for_input(self, req_id: str, max_steps: int = 20) -> None:
        """Step until streaming session `req_id` has ended its turn and waits
        for its next chunk (keeping its KV); fail if it does not within
        `max_steps`."""
        session = self.scheduler.requests[req_id]
        for _ in range(max_steps):
            self.step()
            if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                return
        raise AssertionError(f"{req_id} never waited for input: {session.status}")

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
