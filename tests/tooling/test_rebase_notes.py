"""Each release's REBASE.md names exactly the patches of its series (issue
41: patches/v0.28.0/REBASE.md listed 7 patches while the series had 9).

`make rebase` writes REBASE.md with a table of where each patch of the
series it came from went (its "now" column names the new file). A patch
added to the series afterwards, by hand, goes in the table under
ADDED_HEADING: its file, its subject as the patch has it, and how it came.
"""

from __future__ import annotations

import re

import pytest

from keep.fix_ids import fix_ids, slug_ids, with_fix_ids
from lib.errors import ForkError
from lib.series import find_series

ADDED_HEADING = "## Added to this series after the rebase"
WRITE_IDS = "python3 scripts/keep/fix_ids.py --write-rebase-notes"
PATCH_NAME = re.compile(r"\d{4}-\S+\.patch")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def kept_by_the_rebase(text: str) -> list[str]:
    """The "now" column of the rebase's table: the files its patches became."""
    head = text.split(ADDED_HEADING)[0]
    return [
        row[3]
        for row in map(cells, head.splitlines())
        if len(row) >= 4 and PATCH_NAME.fullmatch(row[0]) and row[3] != "dropped"
    ]


def added_after(text: str) -> dict[str, str]:
    """The added table: file -> subject."""
    if ADDED_HEADING not in text:
        return {}
    tail = text.split(ADDED_HEADING, 1)[1].split("\n## ")[0]
    return {
        row[0]: row[1]
        for row in map(cells, tail.splitlines())
        if len(row) >= 3 and PATCH_NAME.fullmatch(row[0])
    }


RELEASES = find_series()[1:]


@pytest.mark.parametrize("series", RELEASES, ids=lambda s: s.dir.name)
def test_rebase_md_names_exactly_the_patches_of_its_series(series):
    text = (series.dir / "REBASE.md").read_text()
    kept, added = kept_by_the_rebase(text), added_after(text)
    have = {p.name: p.subject() for p in series.patches()}
    named = kept + list(added)
    assert len(named) == len(set(named)), f"named twice: {sorted(named)}"
    assert set(named) == set(have), (
        f"{series.dir.name}/REBASE.md names {len(named)} patches, the series has "
        f"{len(have)}; missing: {sorted(set(have) - set(named))}, not in the "
        f"series: {sorted(set(named) - set(have))}"
    )
    wrong = {n: s for n, s in added.items() if s != have[n]}
    assert not wrong, f"subjects differ from the patches': {wrong}"


def test_every_release_but_the_default_has_notes():
    assert len(RELEASES) >= 20
    assert all((s.dir / "REBASE.md").is_file() for s in RELEASES)


@pytest.mark.parametrize("series", RELEASES, ids=lambda s: s.dir.name)
def test_each_patch_file_in_rebase_md_has_its_fix_id(series):
    """Issue 41: one name per fix across releases. Each row that names a
    patch file carries, in the last column `fix`, the fix id of the file
    (the patch it is now; for a dropped one, the one it was): the number
    the README's table, the ledger and `make apply` give it."""
    all_series = find_series()
    ids = fix_ids(all_series)
    text = (series.dir / "REBASE.md").read_text()
    expected = with_fix_ids(text, series, ids, slug_ids(all_series, ids))
    assert text == expected, (
        f"{series.dir.name}/REBASE.md: the fix ids of its tables are missing or "
        f"stale; write them with `{WRITE_IDS}`"
    )
    rows = [
        cells(line)
        for line in text.splitlines()
        if line.startswith("| ") and PATCH_NAME.fullmatch(cells(line)[0])
    ]
    assert rows and all(row[-1] in ids.values() for row in rows)


def test_fix_ids_are_written_for_kept_dropped_and_added_patches():
    """The column made from a table without it: a kept patch by its file
    now, a dropped one by the file it was (its slug, the same in every
    series), an added one by its file; a second pass changes nothing, and a
    file no series has is refused."""
    all_series = find_series()
    ids = fix_ids(all_series)
    slugs = slug_ids(all_series, ids)
    series = next(s for s in RELEASES if s.dir.name == "v0.28.0")
    kept = series.patches()[2].name  # 0003 there, fix 0004
    dropped = "0003-KVConnector-Pin-SimpleCPUOffload-CPU-hits-until-they.patch"
    added_patch = next(p for p in series.patches() if "session-preempted" in p.name)
    added = added_patch.name  # fix 0017 there
    text = (
        "| patch | state | detail | now |\n| --- | --- | --- | --- |\n"
        f"| 0009-old-name.patch | clean | applies | {kept} |\n"
        f"| {dropped} | upstream | fixed | dropped |\n\n{ADDED_HEADING}\n\n"
        "| patch | subject | how |\n| --- | --- | --- |\n"
        f"| {added} | {added_patch.subject()} | by hand |\n"
    )
    written = with_fix_ids(text, series, ids, slugs)
    rows = [cells(line) for line in written.splitlines() if line.startswith("|")]
    assert rows[0][-1] == rows[4][-1] == "fix"
    assert [rows[2][-1], rows[3][-1], rows[6][-1]] == ["0004", "0003", "0017"]
    assert with_fix_ids(written, series, ids, slugs) == written
    with pytest.raises(ForkError, match="no fix id"):
        with_fix_ids(
            text.replace(dropped, "0001-no-such-fix.patch"), series, ids, slugs
        )
