"""The fake model runner and the worker's step (harness.engine drives them;
tests/in_server/model_free_worker.py runs them in a real server).

FakeModelRunner keeps block tables from the scheduler's output as a real
runner does, "computes" KV by writing a content tag into every block it
fills, and checks the tag of every block it attends to (ContentOracle);
worker_step calls the SimpleCPUOffload worker in the order each release's
model runner does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.config import (
    VllmConfig,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

from harness.config import (
    NULL_BLOCK_ID,
    HarnessConfig,
)
from harness.fake_cuda import CopyEngine, FakeCuda


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


def holds_past(got: Any, want: Any, kind: str, own_full: Any = None) -> bool:
    """Whether a block of `kind` tagged `got` holds the tokens of `want` (a
    partial block) and more after them: a longer partial block, or the
    whole block as the reading request's own tokens fill it (`own_full`,
    its full tag for that block: a fine-grained hit that ends inside a
    block another request computed to its end, as an EAGLE drop leaves
    one). A step reads a block's keys only up to the sequence's length and
    writes the positions it computes before its attention reads them, so
    positions past a hit that ends inside a block are never read stale.
    Not for a Mamba group, whose block is one state: the state after more
    tokens is another state."""
    if kind == "mamba" or not isinstance(got, tuple) or want[0] != "part":
        return False
    if own_full is not None and got == own_full:
        return True
    return (
        len(got) == 4
        and got[0] == "part"
        and got[1:3] == want[1:3]
        and got[3][: len(want[3])] == want[3]
    )


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
        block_sizes: list[int] | None = None,
    ):
        """`forward(name, reads, writes)` launches the forward on the compute
        stream: it reads the blocks `reads` and writes `writes` (block id ->
        KV tag). `block_sizes`: the tokens a block of each group holds, as
        the scheduler counts them (default: the groups' specs')."""
        self.cfg, self.kv, self.requests = cfg, kv, requests
        self.forward = forward
        self.block_sizes = block_sizes or cfg.group_block_sizes()
        self.kinds = cfg.group_kinds()
        if cfg.ring:
            # Per-request scratch that no prefix hit, store or load touches.
            self.block_sizes = self.block_sizes[:-1]
        self.oracle = ContentOracle(self.block_sizes)
        self.tables: dict[str, list[list[int]]] = {}
        self.violations: list[Violation] = []
        self.num_groups = len(self.block_sizes)
        # Speculative decoding: each request's tokens computed once its last
        # step here is done, every draft of it rejected. Under async
        # scheduling the scheduler counts a step's drafts as computed until
        # it processes that step's output, so the next step it sends starts
        # past the truth, and the runner starts it here instead (a real
        # runner corrects its positions by the accepted count it holds).
        self._computed_after: dict[str, int] = {}

    def _update_tables(self, so: SchedulerOutput) -> dict[str, int]:
        computed: dict[str, int] = {}
        for req_id in so.preempted_req_ids or ():
            self.tables.pop(req_id, None)
            self._computed_after.pop(req_id, None)
        for req_id in so.finished_req_ids:
            self.tables.pop(req_id, None)
            self._computed_after.pop(req_id, None)
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
            truth = self._computed_after.get(req_id)
            if truth is not None and req_id not in cached.resumed_req_ids:
                computed[req_id] = min(computed[req_id], truth)
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
        # Each block's writers this step, in batch order: (request, tag).
        written: dict[int, list[tuple[str, Any]]] = {}
        # What each request reads: (request, group, index, block, tag, kind).
        to_check: list[tuple[str, int, int, int, Any, str]] = []
        spec = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            c = computed[req_id]
            # The drafts are the step's last tokens, after the one sampled
            # last; a step with fewer rows than 1 + drafts is no step the
            # worker can run (vLLM's sampler reads 1 + drafts rows of it).
            drafts = len(spec.get(req_id, ()))
            if drafts and n < 1 + drafts:
                raise AssertionError(
                    f"step {step}: {req_id} is scheduled {n} tokens with "
                    f"{drafts} draft tokens: the worker would sample past the "
                    "tokens the step computes"
                )
            table = self.tables[req_id]
            for g, bs in enumerate(self.block_sizes):
                for i in self._needed(g, c):
                    bid = table[g][i]
                    want = self.oracle.tag(req, g, i, min(bs, c - i * bs))
                    to_check.append((req_id, g, i, bid, want, self.kinds[g]))
                    if bid != NULL_BLOCK_ID:
                        reads.append(bid)
                # The blocks the tokens fall in. In a Mamba group block i
                # gets the state after its last token (the tag of the tokens
                # up to there): align mode's table has null blocks but the
                # one of the step's last token, "all" mode's none. Modelled
                # exactly (cfg.mamba_align_state), align mode writes one
                # state, after the step's last token, into that token's
                # block: a block the step starts inside keeps the state it
                # held, so a chunk that ends inside a block leaves it a
                # state short of the block's end.
                first = c // bs
                exact = self.cfg.mamba == "align" and self.cfg.mamba_align_state
                if self.kinds[g] == "mamba" and exact:
                    first = (c + n - 1) // bs
                for i in range(first, (c + n - 1) // bs + 1):
                    bid = table[g][i]
                    if bid != NULL_BLOCK_ID:
                        tag = self.oracle.tag(req, g, i, min(bs, c + n - i * bs))
                        writes[bid] = tag
                        written.setdefault(bid, []).append((req_id, tag))
            req_ids.append(req_id)
            # Every draft rejected: the token sampled follows the step's
            # first `n - drafts` tokens.
            done = c + n - drafts
            if self.cfg.num_speculative_tokens:
                self._computed_after[req_id] = done
            done_prefill = done >= req.num_tokens
            sampled.append([sampled_token(req_id, done)] if done_prefill else [])
        for req_id, g, i, bid, want, kind in to_check:
            # On a GPU every write of the batch lands before attention reads
            # (layer by layer), so a request reads what any other request of
            # the step wrote, whatever the batch order: a block two requests
            # share is read as the other left it. Its own write covers only
            # positions past what it reads.
            got = None
            if bid != NULL_BLOCK_ID:
                others = [t for r, t in written.get(bid, ()) if r != req_id]
                got = others[-1] if others else self.kv.gpu.get(bid)
            if got == want:
                continue
            own_full = None
            if isinstance(got, tuple) and got[0] == "full" and want[0] == "part":
                req = self.requests[req_id]
                own_full = self.oracle.tag(req, g, i, self.oracle.block_size(g))
            if not holds_past(got, want, kind, own_full):
                self.violations.append(Violation(step, req_id, g, i, bid, want, got))
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
    failed_loads: Callable[
        [set[str] | None], tuple[set[int], set[str]]
    ] = lambda recving: (set(), set()),
    host_sync: bool = True,
) -> ModelRunnerOutput:
    """The worker side of one step, in the model runner's order: the
    connector's calls around the forward, as each release's runner makes
    them. `failed_loads(recving)` names the blocks whose load failed and the
    requests whose load failed as a whole.
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
            invalid, failed = failed_loads(recving)
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
                # Passed only when set: not every release has the field.
                **({"invalid_block_ids": invalid} if invalid else {}),
                **({"failed_recving": failed} if failed else {}),
            )
            worker.clear_connector_metadata()
    if host_sync:
        cuda.host_sync()
    return out
