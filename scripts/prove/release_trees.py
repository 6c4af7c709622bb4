"""A series' two trees under .work/v<version>/: base (bare upstream) and
series (base + patches + overlay).

Here rather than in run_tests.py so that e2e.py, which run_tests.py runs,
can build them without the two importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from keep.apply import apply_series, checkout_base
from lib.paths import WORK
from lib.series import Series


@dataclass
class Trees:
    series: Series
    version: str
    base: Path
    patched: Path


def prepare(series: Series) -> Trees:
    version = series.base().version
    work = WORK / f"v{version}"
    base_tree, patched = work / "base", work / "series"
    checkout_base(series, base_tree)
    apply_series(series, patched)
    return Trees(series, version, base_tree, patched)
