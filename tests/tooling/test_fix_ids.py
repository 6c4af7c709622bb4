"""One name per fix across releases: every patch of every series has
exactly one fix id, and the README's release table, the ledger and `make
apply`'s progress lines use those ids (keep/fix_ids.py)."""

from __future__ import annotations

import re

import pytest

from keep.fix_ids import fix_ids, progress_label, series_fix_ids
from keep.release_table import BEGIN, END, pinned_fix_ids, release_patches
from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import Series, find_series, series_for_version

ALL = find_series()
IDS = fix_ids(ALL)


def readme_table() -> tuple[list[str], dict[str, set[str]]]:
    """The README release table's fix columns, and each release's carried ids."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in block.splitlines()
        if line.startswith("|")
    ]
    header, body = rows[0], rows[2:]
    columns = header[2:]
    carried = {
        row[0]: {c for c, cell in zip(columns, row[2:], strict=True) if cell == "yes"}
        for row in body
    }
    return columns, carried


@pytest.mark.parametrize("series", ALL, ids=lambda s: s.base().version)
def test_every_patch_has_exactly_one_fix_id(series: Series):
    found = series_fix_ids(series, IDS)
    assert len(found) == len(series.patches())
    assert len(set(found)) == len(found)
    assert all(re.fullmatch(r"\d{4}|R\d+", f) for f in found)


def test_every_release_fix_has_its_id_for_good():
    """Each R label is in scripts/data/fix_ids.toml: the README, the ledger,
    the docs and past commit messages name fixes by it."""
    pinned = pinned_fix_ids()
    given = release_patches(ALL[0], ALL)
    loose = {s: label for s, label in given.items() if pinned.get(s) != label}
    assert not loose, f"add to scripts/data/fix_ids.toml: {loose}"


class FakeSeries:
    """What release_patches reads of a series: its release and subjects."""

    def __init__(self, version: str, subjects: list[str]) -> None:
        self.version, self.subjects = version, subjects

    def base(self):
        return self

    def patches(self):
        return [type("P", (), {"subject": lambda _, s=s: s})() for s in self.subjects]


def test_a_fix_added_later_on_an_older_release_renumbers_none():
    default = FakeSeries("0.20.2", ["Default fix"])
    newer = FakeSeries("0.30.0", ["Default fix", "Newer fix"])
    older = FakeSeries("0.24.0", ["Default fix", "Added later"])
    # Unpinned, the fix on the older release would take R1 from "Newer fix".
    assert release_patches(default, [default, newer, older], pinned={}) == {
        "Added later": "R1",
        "Newer fix": "R2",
    }
    kept = release_patches(default, [default, newer, older], pinned={"Newer fix": "R1"})
    assert kept == {"Newer fix": "R1", "Added later": "R2"}


def test_the_readme_table_names_fixes_by_their_ids():
    columns, carried = readme_table()
    assert columns == list(dict.fromkeys(IDS.values()))
    for series in ALL:
        assert carried[series.base().version] == set(series_fix_ids(series, IDS))


def test_the_ledger_names_carried_fixes_by_their_ids():
    ledger = (ROOT / "docs" / "ledger.md").read_text()
    named = set(re.findall(r"carried: (\w+)", ledger))
    assert named and named <= set(IDS.values())


def test_make_apply_says_the_fix_id_when_the_number_differs():
    on_0_28 = series_for_version("0.28.0").patches()
    assert on_0_28[2].name.startswith("0003-KVConnector-Store-the-final-blocks")
    assert progress_label(on_0_28[2], IDS) == "  (fix 0004)"
    assert progress_label(on_0_28[0], IDS) == ""  # 0001 is 0001
    assert [progress_label(p, IDS) for p in ALL[0].patches()] == [""] * len(
        ALL[0].patches()
    )
    assert "(fix R" in "".join(progress_label(p, IDS) for p in on_0_28)


def test_a_patch_with_no_fix_id_is_refused(tmp_path):
    series = tmp_path / "patches"
    series.mkdir()
    (series / "base.toml").write_text((ALL[0].dir / "base.toml").read_text())
    (series / "0001-Something-new.patch").write_text(
        "From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] Something new\n\nx\n"
    )
    with pytest.raises(ForkError, match="no fix id"):
        series_fix_ids(Series(series), IDS)
