"""matrix: the synthetic five-patch series measured on two releases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import NEW_RELEASE, REPRODUCER

from keep import matrix


def test_matrix_measures_patches_and_reproducers(five, project, tmp_path):
    releases = {"9.9.10": five.release("9.9.10", NEW_RELEASE)}
    out = tmp_path / "matrix"
    result = matrix.build(
        five.series,
        ["9.9.9", "9.9.10"],
        out=out,
        repro_root=project,
        python=Path(sys.executable),
        resolve=releases.__getitem__,
        cache=five.cache,
        work=tmp_path / "work",
    )
    cells = {
        v: [r["state"] for r in result["releases"][v]["patches"].values()]
        for v in ("9.9.9", "9.9.10")
    }
    assert cells["9.9.9"] == ["applies"] * 5
    assert cells["9.9.10"] == [
        "applies",
        "applies (3-way)",
        "upstream (fixed)",
        "upstream (code)",
        "conflict",
    ]
    verdicts = {
        v: result["releases"][v]["reproducers"][REPRODUCER]["verdict"]
        for v in ("9.9.9", "9.9.10")
    }
    assert verdicts == {"9.9.9": "fails", "9.9.10": "passes"}
    assert json.loads((out / "matrix.json").read_text()) == result
    md = (out / "matrix.md").read_text()
    assert "| patch | 9.9.9 | 9.9.10 |" in md
    assert "| 0005-Conflict-change-line-20.patch | applies | conflict |" in md
    # The scratch tree is left with no am in progress.
    assert not (out / "tree" / ".git" / "rebase-apply").exists()


def test_a_broken_reproducer_is_reported_not_taken_for_the_bug(five, project, tmp_path):
    # On 9.9.10 the function the reproducer imports is gone.
    gone = {**NEW_RELEASE, "vllm/v1/core/kv_cache_utils.py": "def other():\n    pass\n"}
    releases = {"9.9.10": five.release("9.9.10", gone)}
    result = matrix.build(
        five.series,
        ["9.9.10"],
        out=tmp_path / "matrix",
        repro_root=project,
        python=Path(sys.executable),
        resolve=releases.__getitem__,
        cache=five.cache,
        work=tmp_path / "work",
    )
    v = result["releases"]["9.9.10"]["reproducers"][REPRODUCER]
    assert v["verdict"] == "broken"
    assert "ImportError" in v["message"] or "popleft_n" in v["message"]
    md = (tmp_path / "matrix" / "matrix.md").read_text()
    assert "broken [1]" in md and "Notes:" in md
