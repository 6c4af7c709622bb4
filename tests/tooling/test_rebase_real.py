"""The real rebase: the 0.20.2 series onto 0.33.0 ends in the committed
patches/v0.33.0 with no hand edit (the resolution store replays every
conflict). Minutes: fetches 0.33.0 and runs the reproducers on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from keep import rebase
from keep.resolutions import STORE, check_store
from lib.paths import DEFAULT_SERIES, OVERLAY
from lib.series import Series, read_base

COMMITTED = DEFAULT_SERIES / "v0.33.0"


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_0_20_2_series_rebases_onto_0_33_0_as_committed(tmp_path):
    into = tmp_path / "v0.33.0"
    shutil.copytree(COMMITTED, into)
    shutil.copytree(STORE, tmp_path / "resolutions")  # the store beside INTO
    state = rebase.start(
        Series(DEFAULT_SERIES, overlay=OVERLAY),
        read_base(COMMITTED / "base.toml"),
        into,
        tmp_path / "tree",
    )
    assert all(e.state in ("clean", "merged", "upstream") for e in state.patches)
    assert not any("by hand" in e.detail for e in state.patches)
    assert files(into) == files(COMMITTED)
    assert check_store(tmp_path / "resolutions", [into]) == []
