"""Check every reservation the scheduler reads against a recount.

The series keeps, for the async-load admission gate, the KV blocks each
in-flight prefill still needs as a running total (`InflightPrefills`,
patch "admit an async KV load only if in-flight prefills still fit"), and
counts a request again only where the scheduler says it changed. A change
site it misses leaves a stale need in the total: an admission then
reserves too much (a load waits for nothing) or too little (loads strand
each other). Checking at step boundaries would not see it, since the end
of every step marks the requests it scheduled; so each value the
scheduler reads is compared, when it reads it, with the sum counted anew
over every in-flight prefill. On a tree without the running total (the
bare releases) nothing is installed. From 0.23.0, where upstream sums per
admission, the series keeps the same running total (release patch
"keep the in-flight prefills' reservation as a running total").
"""

from __future__ import annotations

from typing import Any


def recount(prefills: Any, candidate: Any = None) -> int:
    """The reservation summed anew: every in-flight prefill but `candidate`,
    each counted now by the scheduler's own count."""
    return sum(
        prefills._count_needed(request)
        for request in list(prefills)
        if request is not candidate
    )


def install(scheduler: Any) -> bool:
    """Make the scheduler's reservation reads fail on any stale count.
    Returns whether the tree keeps a running total to check."""
    prefills = getattr(scheduler, "_inflight_prefills", None)
    kept = getattr(prefills, "reserved_blocks", None)
    if kept is None or not hasattr(prefills, "_count_needed"):
        return False

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
        return got

    prefills.reserved_blocks = checked
    return True
