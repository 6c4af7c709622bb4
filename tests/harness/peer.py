"""A peer engine that shares a BlockPool, as kvcached's engines do (seed 003).

vLLM counts free blocks, then allocates them. With a pool shared by several
engines another engine can take blocks in between. PeerEngine stands in for
that engine: it wraps the pool's get_new_blocks and, when armed, takes
blocks just before one of the next calls, so that call is short.

With `raises`, a strike raises that error from the call instead, as
kvcached's own pool does when another engine took the physical pages
behind its free count (`kvcached.utils.KVCachePoolExhausted`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PeerEngine:
    def __init__(
        self, pool: Any, raises: Callable[[str], Exception] | None = None
    ) -> None:
        self.pool = pool
        self.raises = raises
        self._get_new_blocks = pool.get_new_blocks
        self.held: list[Any] = []
        self.calls = 0
        self.strikes: list[tuple[int, int]] = []  # (call number, blocks asked)
        self._strike_at: int | None = None
        # Bound as an instance attribute: every caller of the pool's
        # get_new_blocks (the managers of all KV cache groups) goes through it.
        pool.get_new_blocks = self._intercept

    def arm(self, after_calls: int = 0) -> None:
        """Strike at the get_new_blocks call `after_calls` calls from now."""
        self._strike_at = self.calls + after_calls

    def disarm(self) -> None:
        self._strike_at = None

    @property
    def armed(self) -> bool:
        return self._strike_at is not None

    def _intercept(self, num_blocks: int) -> list[Any]:
        if self._strike_at == self.calls:
            if num_blocks == 0:
                # Nothing to make short: strike at the next call instead.
                self._strike_at += 1
            elif self.raises is not None:
                self._strike_at = None
                self.strikes.append((self.calls, num_blocks))
                self.calls += 1
                raise self.raises(f"the peer took the pages for {num_blocks} blocks")
            else:
                self._strike_at = None
                # Leave one block fewer than this call asks for.
                take = self.pool.get_num_free_blocks() - num_blocks + 1
                if take > 0:
                    self.held += self._get_new_blocks(take)
                self.strikes.append((self.calls, num_blocks))
        self.calls += 1
        return self._get_new_blocks(num_blocks)

    def release(self) -> None:
        """Give the peer's blocks back to the pool."""
        self.pool.free_blocks(self.held)
        self.held = []
