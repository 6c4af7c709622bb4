"""A burst of CPU hits on the harness, with the work the scheduler's
admission gate does for it counted (tests/reproducers/
test_reservation_is_counted_once.py, test_semantic_mutants.py)."""

from __future__ import annotations

from typing import Any

from harness.engine import Engine, HarnessConfig

BS = 16
LOADS = 60  # async loads admitted in one burst
PREFIX_BLOCKS = 4


def prefix(i: int) -> list[int]:
    return [100_000 + 1000 * i + t for t in range(PREFIX_BLOCKS * BS)]


def count_calls(obj: Any, name: str, counter: dict[str, int]) -> None:
    real = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        return real(*args, **kwargs)

    setattr(obj, name, counted)


def burst_of_cpu_hits() -> dict[str, int]:
    """Admit LOADS async loads together and count get_num_blocks_to_allocate
    and allocate_slots calls until they finish."""
    # Plenty of GPU blocks, loads that land 3 steps after launch: the whole
    # burst is admitted and in flight together.
    e = Engine(
        HarnessConfig(
            block_size=BS,
            num_gpu_blocks=1024,
            num_cpu_blocks=1024,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            transfer_delay=lambda is_store: 3,
            # The recount would be the very quadratic sum measured here.
            check_reservations=False,
        )
    )
    for i in range(LOADS):
        # Past the prefix and a few steps long: its blocks are stored before
        # it finishes, on the bare release too.
        e.add_request(prefix(i) + [1] * 5, max_tokens=3)
    e.run()
    # Only the CPU holds the prefixes now: each request below loads one.
    assert e.block_pool.reset_prefix_cache()

    calls = {"get_num_blocks_to_allocate": 0, "allocate_slots": 0}
    count_calls(
        e.scheduler.kv_cache_manager.coordinator, "get_num_blocks_to_allocate", calls
    )
    count_calls(e.scheduler.kv_cache_manager, "allocate_slots", calls)
    burst = [e.add_request(prefix(i) + [7, 8, 9], max_tokens=2) for i in range(LOADS)]
    e.run(max_steps=500)

    assert set(burst) <= e.stats.finished
    loads = [x for x in e.copy_backend.launched if not x["is_store"]]
    assert len(loads) >= 1 and e.runner.violations == []
    return calls


def within_linear_bound(calls: dict[str, int]) -> bool:
    """Each allocate_slots counts once (and a waiting request's whole-prompt
    check once more); a running total adds at most a count per request per
    change, which the same calls bound. A per-admission sum adds about
    LOADS^2 / 2 = 1,800 here."""
    return calls["get_num_blocks_to_allocate"] <= 3 * calls["allocate_slots"] + LOADS
