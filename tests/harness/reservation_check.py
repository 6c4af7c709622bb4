"""Check every reservation the scheduler reads against a recount, and every
change to an in-flight prefill against the marks the scheduler makes.

The series keeps, for the async-load admission gate, the KV blocks each
in-flight prefill still needs as a running total (`InflightPrefills`,
patch "admit an async KV load only if in-flight prefills still fit"), and
counts a request again only where the scheduler marks it changed (touch).
A change site it misses leaves a stale need in the total: an admission
then reserves too much (a load waits for nothing) or too little (loads
strand each other).

Two checks. Each value the scheduler reads is compared, when it reads it,
with the sum counted anew over every in-flight prefill. And at each read,
and after each schedule, update_from_output and add_request, every
in-flight prefill not marked since the total last counted it must still be
as it was then: its token counts and, per group, how many blocks it holds
and whether the group registered it. The first alone misses a change the
count does not read today (a prefill chunk's computed tokens) and one that
the running requests' allocations happen to mark before the next read;
either is a mark missing that a rebase, or another path, would turn into a
stale total. On a tree without the running total (the bare releases)
nothing is installed. From 0.23.0, where upstream sums per admission, the
series keeps the same running total (release patch "keep the in-flight
prefills' reservation as a running total").
"""

from __future__ import annotations

from typing import Any


def recount(prefills: Any, candidate: Any = None) -> int:
    """The reservation summed anew: every in-flight prefill but `candidate`,
    each counted now by the scheduler's own count."""
    count = getattr(prefills, "_scheduler_count", prefills._count_needed)
    return sum(count(request) for request in list(prefills) if request is not candidate)


def counted_inputs(scheduler: Any, request: Any) -> tuple:
    """What a request's count reads of it: its token counts and, per KV
    cache group, how many blocks it holds and whether the group has
    registered it. (Not the block ids: a sliding window's blocks turning
    null leave its count as it was.)"""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return (
        request.num_tokens,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        tuple(
            (
                len(m.req_to_blocks.get(request.request_id, ())),
                request.request_id in getattr(m, "num_cached_block", ()),
            )
            for m in managers
        ),
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


def _fail_on_unmarked(scheduler: Any, where: str) -> None:
    problems = unmarked_changes(scheduler)
    if problems:
        raise AssertionError(f"after {where}: " + "; ".join(problems))


def install(scheduler: Any) -> bool:
    """Make the scheduler's reservation reads fail on any stale count.
    Returns whether the tree keeps a running total to check.

    At each read the total must equal a recount. And at each read, and
    after each call that can change a request (schedule, update_from_output,
    add_request), every in-flight prefill must be as it was when the total
    last counted it, unless it is marked to be counted again. The second
    check sees a change the count does not read today (a prefill chunk's
    computed tokens, where the count reads only the blocks): it still
    breaks the rule the running total rests on, and a rebase onto a count
    that reads it would leave the total stale with no test failing. It also
    sees a change between reads: the next read may come after the running
    requests' allocations have marked the request anyway, by chance."""
    prefills = getattr(scheduler, "_inflight_prefills", None)
    kept = getattr(prefills, "reserved_blocks", None)
    if kept is None or not hasattr(prefills, "_count_needed"):
        return False
    count = prefills._count_needed
    # Each request's inputs when the running total last counted it.
    counted_at: dict[Any, tuple] = {}

    def counting(request: Any) -> int:
        counted_at[request] = counted_inputs(scheduler, request)
        return count(request)

    def checked(candidate: Any = None) -> int:
        want = recount(prefills, candidate)
        got = kept(candidate)
        if got != want:
            raise AssertionError(
                f"in-flight prefills reserve {got} blocks, a recount gives "
                f"{want} (candidate {getattr(candidate, 'request_id', None)}): "
                "a change to a request's blocks or computed tokens was not "
                "marked (InflightPrefills.touch)"
            )
        _fail_on_unmarked(scheduler, "a reservation read")
        for request in [r for r in counted_at if r not in prefills]:
            del counted_at[request]
        return got

    # The scheduler's own count, for the recount: counting through the
    # wrapper would record the request as counted by the running total.
    prefills._scheduler_count = count
    prefills._counted_at = counted_at
    prefills._count_needed = counting
    prefills.reserved_blocks = checked
    for name in ("schedule", "update_from_output", "add_request"):
        _check_after(scheduler, name)
    return True


def _check_after(scheduler: Any, name: str) -> None:
    call = getattr(scheduler, name)

    def checked_call(*args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        _fail_on_unmarked(scheduler, name)
        return result

    setattr(scheduler, name, checked_call)
