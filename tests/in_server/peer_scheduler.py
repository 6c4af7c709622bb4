# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --scheduler-cls` for seed 003: a peer engine on the pool.

The release's own Scheduler, with the harness's PeerEngine on its block
pool, as a colocated engine sharing the pool (kvcached) would be: every
VLLM_FORK_E2E_PEER_EVERY-th schedule() the peer arms, takes blocks between
the manager's free count and its grab (so that grab is one block short),
and lets go of them VLLM_FORK_E2E_PEER_HOLD steps later. Each strike is
appended to the JSON-lines file VLLM_FORK_E2E_PEER for the client to count.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from harness.peer import PeerEngine

EVERY = int(os.environ.get("VLLM_FORK_E2E_PEER_EVERY", "5"))
HOLD = int(os.environ.get("VLLM_FORK_E2E_PEER_HOLD", "4"))


class PeerScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer = PeerEngine(self.kv_cache_manager.block_pool)
        self._log = os.environ.get("VLLM_FORK_E2E_PEER")
        self._steps = 0
        self._struck_at: int | None = None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._steps += 1
        if self._struck_at is not None and self._steps - self._struck_at >= HOLD:
            self.peer.release()
            self._struck_at = None
        if self._struck_at is None and not self.peer.armed and self._steps % EVERY == 0:
            self.peer.arm()
        strikes, held = len(self.peer.strikes), len(self.peer.held)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            if len(self.peer.strikes) > strikes:
                self._struck_at = self._steps
                _, asked = self.peer.strikes[-1]
                self._record(asked, took=len(self.peer.held) - held)

    def _record(self, asked: int, took: int) -> None:
        """One strike: the blocks the grab asked for, and those the peer
        took just before it (0: the pool had too few to leave it short)."""
        if self._log:
            line = {"step": self._steps, "asked": asked, "took": took}
            with open(self._log, "a") as f:
                f.write(json.dumps(line) + "\n")
