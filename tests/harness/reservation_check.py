"""Check every reservation the scheduler reads against a recount, and every
change to an in-flight prefill against the marks the scheduler makes.

The series keeps, for the async-load admission gate, the KV blocks each
in-flight prefill still needs as a running total (`InflightPrefills`,
patch "admit an async KV load only if in-flight prefills still fit"), and
counts a request again only where the scheduler marks it changed (touch).
A change site it misses leaves a stale need in the total: an admission
then reserves too much (a load waits for nothing) or too little (loads
strand each other).

Each value the scheduler reads is compared, when it reads it, with the sum
counted anew over every in-flight prefill. That alone misses a change the
count does not read today (a prefill chunk's computed tokens) and one that
the running requests' allocations happen to mark before the next read:
marks missing that a rebase, or another path, turns into a stale total.
So, at each read and before and after each schedule, update_from_output
and add_request, every in-flight prefill not marked since the total last
counted it must still be as it was then (see counted_inputs), and none may
be finished or running past its prefill. On a tree without the running
total (the bare releases) nothing is installed. From 0.23.0, where
upstream sums per admission, the series keeps the same running total
(release patch "keep the in-flight prefills' reservation as a running
total").
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus


def recount(count: Any, prefills: Any, candidate: Any = None) -> int:
    """The reservation summed anew with the scheduler's own `count`: every
    in-flight prefill but `candidate`."""
    return sum(count(request) for request in list(prefills) if request is not candidate)


def counted_inputs(scheduler: Any, request: Any) -> tuple:
    """What a request's count reads of it: its token counts and, per KV
    cache group, how many blocks it holds and how many of them are null (a
    sliding window's skipped blocks; Mamba align mode's checkpoints),
    whether the group registered it, and Mamba align mode's marks of a
    partial hit and of blocks allocated this step. (HiSparse's host pool is
    shared by every request, and its scheduler counts every request again at
    each read: not checked, see install.)"""
    request_id = request.request_id
    groups = []
    for m in scheduler.kv_cache_manager.coordinator.single_type_managers:
        blocks = m.req_to_blocks.get(request_id, ())
        groups.append(
            (
                len(blocks),
                sum(block.is_null for block in blocks),
                request_id in getattr(m, "num_cached_block", ()),
                request_id in getattr(m, "_partial_hit_reqs", ()),
                request_id in getattr(m, "_allocated_block_reqs", ()),
            )
        )
    return (
        request.num_tokens,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        tuple(groups),
    )


def unmarked_changes(scheduler: Any) -> list[str]:
    """In-flight prefills that changed since the running total last counted
    them and are not marked to be counted again."""
    prefills = scheduler._inflight_prefills
    counted_at = prefills._counted_at
    return [
        f"in-flight prefill {request.request_id} changed since the running "
        f"total counted it ({counted_at.get(request)} -> "
        f"{counted_inputs(scheduler, request)}) and was not marked "
        "(InflightPrefills.touch)"
        for request in prefills
        if request not in prefills._stale
        and counted_at.get(request) != counted_inputs(scheduler, request)
    ]


def strays(scheduler: Any) -> list[str]:
    """Requests in the in-flight set that are not in flight: finished, or
    running past their prefill. Only meaningful between calls: a request's
    prefill flag is settled once `schedule` returns."""
    found = []
    for request in scheduler._inflight_prefills:
        if request.is_finished():
            found.append(
                f"{request.request_id} is finished ({request.status.name}) "
                "and still reserves blocks as an in-flight prefill"
            )
        elif request.status == RequestStatus.RUNNING and not getattr(
            request, "is_prefill_chunk", True
        ):
            found.append(
                f"{request.request_id} runs past its prefill and still "
                "reserves blocks as an in-flight prefill"
            )
    return found


def _fail_on(problems: list[str], where: str) -> None:
    if problems:
        raise AssertionError(f"{where}: " + "; ".join(problems))


def install(scheduler: Any) -> bool:
    """Make the scheduler's reservation reads fail on any stale count, and
    its calls fail on an in-flight prefill changed and not marked.
    Returns whether the tree keeps a running total to check.

    At each read the total must equal a recount. Before and after each call
    that can change a request (schedule, update_from_output, add_request)
    and at each read, every in-flight prefill must be as it was when the
    total last counted it, unless it is marked to be counted again; and
    after each such call the total is read once more, so that every
    in-flight prefill is counted at every call boundary. The second check
    sees a change the count does not read today (a prefill chunk's computed
    tokens, where the count reads only the blocks): it still breaks the
    rule the running total rests on, and a rebase onto a count that reads
    it would leave the total stale with no test failing. It also sees a
    change between reads that the running requests' allocations happen to
    mark before the next read. The extra read changes no decision: a read
    returns the exact total, whenever it is made."""
    prefills = getattr(scheduler, "_inflight_prefills", None)
    kept = getattr(prefills, "reserved_blocks", None)
    if kept is None or not hasattr(prefills, "_count_needed"):
        return False
    if hasattr(prefills, "_counted_at"):
        return True  # installed already
    count = prefills._count_needed
    # Each request's inputs when the running total last counted it.
    counted_at: dict[Any, tuple] = {}
    # A scheduler whose count reads state every request shares (HiSparse)
    # counts every request again at each read and marks nothing: only the
    # recount applies.
    marks_changes = not getattr(prefills, "_recount_every_read", False)

    def counting(request: Any) -> int:
        counted_at[request] = counted_inputs(scheduler, request)
        return count(request)

    def checked(candidate: Any = None) -> int:
        want = recount(count, prefills, candidate)
        got = kept(candidate)
        if got != want:
            raise AssertionError(
                f"in-flight prefills reserve {got} blocks, a recount gives "
                f"{want} (candidate {getattr(candidate, 'request_id', None)}): "
                "a change to a request's blocks or computed tokens was not "
                "marked (InflightPrefills.touch)"
            )
        if marks_changes:
            _fail_on(unmarked_changes(scheduler), "at a reservation read")
        for request in [r for r in counted_at if r not in prefills]:
            del counted_at[request]
        return got

    prefills._counted_at = counted_at
    prefills._count_needed = counting
    prefills.reserved_blocks = checked
    if marks_changes:
        for name in ("schedule", "update_from_output", "add_request"):
            _check_around(scheduler, name, checked)
    return True


def _check_around(scheduler: Any, name: str, read: Any) -> None:
    call = getattr(scheduler, name)

    def checked_call(*args: Any, **kwargs: Any) -> Any:
        _fail_on(unmarked_changes(scheduler) + strays(scheduler), f"before {name}")
        result = call(*args, **kwargs)
        # The read checks for unmarked changes, then counts every request.
        read()
        _fail_on(strays(scheduler), f"after {name}")
        return result

    setattr(scheduler, name, checked_call)
