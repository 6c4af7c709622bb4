"""A differential or soak trace replayed as the campaign's worker ran it
(tests/reproducers/test_differential_seed_31337.py,
tests/harness_tests/test_queue_state.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]


def replay(seed: int, family: str, hash_seed: int) -> dict[str, Any]:
    """The trace's record, with PYTHONHASHSEED at its campaign's seed (the
    outcome depends on set order), so in a process of its own."""
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH"), str(TESTS)) if p
    )
    out = subprocess.run(
        [sys.executable, "-m", "harness.trace_worker", "--seed", str(seed)]
        + ["--family", family],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out[out.index("{") :])


def assert_runs_to_the_end(record: dict[str, Any]) -> None:
    """A replayed trace ends with no crash, no broken invariant, no stall."""
    assert record["crash"] is None, record["crash"]
    assert record["violation"] is None, record["violation"]
    assert not record["stalled"], f"stalled: {record['completed']} completed"
