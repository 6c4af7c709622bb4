"""The bug ledger: docs/ledger.md is what scripts/keep/ledger.py renders from
scripts/data/ledger.toml, the data has the schema its header describes, and
every carried row agrees with the committed series. Offline and fast: it
reads files only, builds no tree and runs no vLLM."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keep import ledger, release_table
from lib import series as series_module
from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import Series, find_series

ROW = """
[[bug]]
id = "{id}"
title = "t"
issues = []
prs = {prs}
fixed_in = "{fixed_in}"
found_by = "reproducer"
affected = {affected}
verdict = "{verdict}"
scope = "s"
{extra}
"""
CARRIED = 'patch = "Fix one"\nreproducers = ["tests/reproducers/test_x.py::test_x"]'


def row(
    id: str = "a",
    verdict: str = "carried",
    affected: str = '["0.19.0", "0.20.2"]',
    fixed_in: str = "",
    prs: str = "[]",
    extra: str = CARRIED,
) -> str:
    return ROW.format(
        id=id,
        verdict=verdict,
        affected=affected,
        fixed_in=fixed_in,
        prs=prs,
        extra=extra,
    )


KNOWN = ["0.19.0", "0.20.2", "0.24.0", "0.100.0"]


def load_text(tmp_path: Path, text: str) -> list[ledger.Bug]:
    path = tmp_path / "ledger.toml"
    path.write_text(text)
    return ledger.load(path, known=KNOWN)


# The committed ledger.


def test_docs_ledger_is_the_rendered_data():
    assert (ROOT / "docs" / "ledger.md").read_text() == ledger.render(ledger.load()), (
        "docs/ledger.md is stale: run `make ledger`"
    )


def test_every_carried_row_agrees_with_the_series():
    # Each release in a carried row's affected range has the patch unless its
    # own code has the fix; no release from the first fixed one carries it;
    # its reproducers are the patch's own Reproducer: trailers.
    view = ledger.SeriesView()
    assert ledger.disagreements(ledger.load(), view) == []


def test_every_patch_of_every_series_is_a_ledger_row():
    # The ledger is every bug the fork fixes: no patch without its row.
    view = ledger.SeriesView()
    carried = {b.patch for b in ledger.load() if b.verdict == "carried"}
    assert set(view.labels) <= carried, set(view.labels) - carried


def test_every_reproducer_the_ledger_names_exists():
    for bug in ledger.load():
        for test_id in bug.reproducers:
            path, _, name = test_id.partition("::")
            source = (ROOT / path).read_text()
            function = name.split("[")[0]
            assert re.search(rf"^def {function}\(", source, re.M), test_id


def test_every_probe_test_the_ledger_names_exists():
    """make test-releases runs these on every series: a renamed test would
    show there as "not run"; here it is named at once."""
    probes = ledger.probe_tests(ledger.load())
    assert (
        "tests/harness_tests/test_engine.py::"
        + ("test_a_failed_load_on_a_mamba_hybrid_stops_the_engine")
        in probes
    )
    for test_id in probes:
        path, _, name = test_id.partition("::")
        source = (ROOT / path).read_text()
        function = name.split("[")[0]
        assert re.search(rf"^def {function}\(", source, re.M), test_id


def test_the_readme_series_table_lists_the_seeds_then_the_ledger():
    readme = (ROOT / "README.md").read_text()
    bugs = ledger.load()
    assert ledger.readme_row(bugs) in readme.splitlines(), (
        "README.md's series table must end with `python3 scripts/keep/ledger.py "
        "--readme`"
    )
    section = readme[
        readme.index("## The series") : readme.index(ledger.readme_row(bugs))
    ]
    listed = re.findall(r"(?m)^\| (\w+) \|", section)
    view = ledger.SeriesView()
    seeds = [view.labels[b.patch] for b in bugs if b.seed]
    assert sorted(listed) == sorted(set(seeds))


# The schema.


def test_a_well_formed_row_loads(tmp_path):
    (bug,) = load_text(tmp_path, row(prs='["vllm-project/vllm#1"]', fixed_in="0.24.0"))
    assert bug.affected == ("0.19.0", "0.20.2")
    assert bug.prs == ("vllm-project/vllm#1",)
    assert bug.reproducers == ("tests/reproducers/test_x.py::test_x",)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (row().replace('scope = "s"\n', ""), "lacks scope"),
        (row(verdict="wontfix"), "verdict 'wontfix'"),
        (row(affected='["0.19.0", "0.21.0"]'), "'0.21.0' is no release"),
        (row(affected='["0.24.0", "0.19.0"]'), "0.24.0 comes after 0.19.0"),
        (row(affected='["0.19.0"]'), "affected must be [first, last]"),
        (row(fixed_in="0.20.2"), "fixed in 0.20.2, yet affected to 0.20.2"),
        (row(fixed_in="0.20.1"), "'0.20.1' is no release"),
        (row(prs='["#12"]'), "PR '#12' is not owner/repo#N"),
        (row(extra='patch = "Fix one"'), "names its reproducers"),
        (row(extra=CARRIED + '\nreason = "r"'), "a carried row has no reason"),
        (row(verdict="will-not", extra='probe = "p"'), "says why (reason)"),
        (row(verdict="cannot-yet", extra='reason = "r"'), "says how it was measured"),
        (
            row(verdict="will-not", extra=CARRIED + '\nreason = "r"\nprobe = "p"'),
            "only a carried row has a patch",
        ),
        (row() + row(), "id 'a' is used twice"),
        (row(extra=CARRIED + '\nsevere = "yes"'), "unknown field severe"),
        (
            row(extra=CARRIED + '\nspared = ["0.19.0"]'),
            "spared '0.19.0' is no release strictly inside affected 0.19.0-0.20.2",
        ),
        (
            row(extra=CARRIED + '\nspared = ["0.24.0"]'),
            "spared '0.24.0' is no release strictly inside",
        ),
        ("", "no [[bug]] rows"),
    ],
)
def test_a_malformed_row_is_refused_saying_why(tmp_path, text, says):
    with pytest.raises(ForkError) as info:
        load_text(tmp_path, text)
    assert says in str(info.value)


# Against a synthetic set of series.


def make_series(d: Path, version: str, subjects: dict[str, list[str]]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "base.toml").write_text(
        f'version = "{version}"\nsdist_url = "u"\nsdist_sha256 = "{"0" * 64}"\n'
    )
    for i, (subject, tests) in enumerate(subjects.items(), 1):
        trailers = "".join(f"Reproducer: {t}\n" for t in tests)
        (d / f"{i:04d}-{subject.replace(' ', '-')}.patch").write_text(
            f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] {subject}\n\n"
            f"Body.\n\n{trailers}---\n"
        )


@pytest.fixture
def view(tmp_path, monkeypatch) -> ledger.SeriesView:
    root = tmp_path / "patches"
    x = ["tests/reproducers/test_x.py::test_x"]
    make_series(root, "0.20.2", {"Fix one": x, "Fix two": x})
    make_series(root / "v0.19.0", "0.19.0", {"Fix one": x, "Fix two": x})
    make_series(root / "v0.24.0", "0.24.0", {"Fix two": x, "Later fix": x})
    make_series(root / "v0.100.0", "0.100.0", {"Later fix": x})
    monkeypatch.setattr(series_module, "DEFAULT_SERIES", root)
    return ledger.SeriesView(find_series())


def test_labels_and_carriers_come_from_the_series(view, tmp_path):
    assert view.releases == KNOWN
    assert view.labels == {"Fix one": "0001", "Fix two": "0002", "Later fix": "R1"}
    # The same labels as README.md's release table.
    default = Series(tmp_path / "patches")
    assert release_table.release_patches(default, find_series()) == {"Later fix": "R1"}
    assert view.carriers("Fix two") == ["0.19.0", "0.20.2", "0.24.0"]
    assert view.spans(["0.19.0", "0.20.2", "0.100.0"]) == "0.19.0-0.20.2, 0.100.0"


def test_a_carried_row_that_disagrees_with_the_series_is_reported(view, tmp_path):
    # Fix one: upstream from 0.24.0, carried on 0.19.0 and 0.20.2: agrees.
    (ok,) = load_text(tmp_path, row(fixed_in="0.24.0"))
    assert ledger.disagreements([ok], view) == []
    # Affected through 0.24.0, whose series lacks it and whose code lacks the fix.
    (short,) = load_text(tmp_path, row(affected='["0.19.0", "0.24.0"]'))
    assert ledger.disagreements([short], view) == [
        "a: the 0.24.0 series lacks 'Fix one'"
    ]
    # Fix two: "fixed" in 0.24.0, whose series still carries it.
    two = row(fixed_in="0.24.0", extra=CARRIED.replace("Fix one", "Fix two"))
    (still,) = load_text(tmp_path, two)
    assert ledger.disagreements([still], view) == [
        "a: fixed upstream in 0.24.0, yet its series carries it"
    ]
    # Unless another row it carries still affects that release.
    needed = row(
        id="b",
        affected='["0.19.0", "0.24.0"]',
        extra=CARRIED.replace("Fix one", "Fix two"),
    )
    assert ledger.disagreements(load_text(tmp_path, two + needed), view) == []
    # Not by a row whose affected releases end before it.
    ended = needed.replace('["0.19.0", "0.24.0"]', '["0.19.0", "0.20.2"]')
    assert ledger.disagreements(load_text(tmp_path, two + ended), view) == [
        "a: fixed upstream in 0.24.0, yet its series carries it"
    ]
    other = row(extra=CARRIED.replace("test_x.py::test_x", "test_y.py::test_y"))
    (named,) = load_text(tmp_path, other)
    assert ledger.disagreements([named], view) == [
        "a: tests/reproducers/test_y.py::test_y is no Reproducer: trailer of 'Fix one'"
    ]
    (gone,) = load_text(tmp_path, row(extra=CARRIED.replace("Fix one", "Gone")))
    assert ledger.disagreements([gone], view) == ["a: no series carries a patch 'Gone'"]


def test_each_release_s_status_of_each_bug(view, tmp_path):
    bugs = load_text(
        tmp_path,
        row(fixed_in="0.24.0")
        + row(
            id="b",
            verdict="will-not",
            affected='["0.20.2", "0.24.0"]',
            extra='reason = "r"\nprobe = "p"',
        ),
    )
    cells = {
        b.id: [ledger.status(b, v, view) for v in [*KNOWN, "0.99.0"]] for b in bugs
    }
    assert cells == {
        "a": [
            "fixed by the fork (patch 0001)",
            "fixed by the fork (patch 0001)",
            "fixed upstream",
            "fixed upstream",
            "unknown",
        ],
        "b": ["-", "open", "open", "-", "unknown"],
    }
    table = ledger.status_table(bugs, ["0.19.0", "0.24.0"], view).splitlines()
    assert table[0] == "| bug | 0.19.0 | 0.24.0 |"
    assert table[2] == "| a | fixed by the fork (patch 0001) | fixed upstream |"


def test_a_spared_release_is_not_affected(view, tmp_path):
    """A release inside `affected` whose own code lacks the bug (a fix a
    later release took back): not affected there, and said so on the page."""
    (bug,) = load_text(
        tmp_path,
        row(
            verdict="will-not",
            affected='["0.19.0", "0.24.0"]',
            extra='reason = "r"\nprobe = "p"\nspared = ["0.20.2"]',
        ),
    )
    assert [ledger.status(bug, v, view) for v in KNOWN[:3]] == ["open", "-", "open"]
    assert "| 0.19.0-0.24.0 (not 0.20.2) |" in ledger.render([bug], view)


def test_the_page_names_each_patch_by_its_number_from_the_series(view, tmp_path):
    bugs = load_text(
        tmp_path,
        row(fixed_in="0.24.0", prs='["vllm-project/vllm#7"]')
        + row(
            id="b",
            verdict="cannot-yet",
            extra='reason = "no harness for it"\nprobe = "p"\nseed = "000"',
        ),
    )
    page = ledger.render(bugs, view)
    assert "2 bugs: 1 carried, 0 the fork will not carry, 1 it cannot yet" in page
    assert (
        "| [t](#a) | - | [vllm#7](https://github.com/vllm-project/vllm/pull/7); "
        "first in 0.24.0 | 0.19.0-0.20.2 | carried: 0001 |"
    ) in page
    assert "| cannot yet: no harness for it |" in page
    assert "- **Carried** by 0001, *Fix one*, in the series of 0.19.0-0.20.2." in page
    assert ledger.readme_row(bugs).startswith("| … | and 1 more from the ledger")


def test_make_matrix_shows_the_ledger_from_the_data_and_the_series():
    from keep import matrix

    statuses = matrix.ledger_statuses(["0.20.2", "0.33.0"])
    assert statuses["async-window-blocks"] == {
        "0.20.2": "fixed by the fork (patch 0012)",
        "0.33.0": "fixed upstream",
    }
    assert statuses["failed-loads-wait"] == {
        "0.20.2": "-",
        "0.33.0": "fixed by the fork (patch R3)",
    }
    assert statuses["prefix-stats-retry"]["0.20.2"] == "open"
    seconds = {"fetch": 1, "environment": 1, "reproducers": 1, "replay": 1}
    md = matrix.markdown(
        {
            "series": "patches",
            "series_base": "0.20.2",
            "patches": [],
            "reproducers": {},
            "releases": {v: {"seconds": seconds} for v in ("0.20.2", "0.33.0")},
            "ledger": statuses,
        }
    )
    assert "## The ledger on each release" in md
    assert (
        "| async-window-blocks | fixed by the fork (patch 0012) | fixed upstream |"
    ) in md.splitlines()


def test_the_release_table_marks_releases_before_a_bug_with_a_dash(tmp_path):
    """A default-series patch a release's series lacks is 'upstream' there,
    unless the ledger's carried rows say its bug starts later: '-'."""
    data = tmp_path / "ledger.toml"
    data.write_text(
        """
[[bug]]
verdict = "carried"
patch = "Fix A"
affected = ["0.20.0", "0.25.1"]

[[bug]]
verdict = "carried"
patch = "Fix A"
affected = ["0.19.1", "0.20.2"]

[[bug]]
verdict = "cannot-yet"
affected = ["0.19.0", "0.33.0"]
"""
    )
    assert release_table.first_affected(data) == {"Fix A": "0.19.1"}
    assert release_table.first_affected(tmp_path / "none.toml") == {}
    # The committed table: 0018's bug starts in 0.20.0 (row
    # eagle-mamba-hit-mismatch), so 0.19.x never had it.
    row = next(
        line
        for line in release_table.table().splitlines()
        if line.startswith("| 0.19.0 |")
    )
    header = release_table.table().splitlines()[0].split("|")
    assert row.split("|")[header.index(" 0018 ")].strip() == "-"


def test_the_release_table_marks_a_release_the_fix_skips_as_open(tmp_path):
    """Past the last release a carried row reaches and before upstream's
    fix, a series without the patch has the bug: 'open', not 'upstream'."""
    data = tmp_path / "ledger.toml"
    data.write_text(
        """
[[bug]]
verdict = "carried"
patch = "Fix A"
affected = ["0.19.0", "0.28.0"]
fixed_in = "0.30.0"
"""
    )
    spans = release_table.still_open(data)
    assert spans == {"Fix A": ("0.28.0", "0.30.0")}
    key = release_table.version_key
    assert release_table.cell(key("0.29.0"), "0.19.0", spans["Fix A"]) == "open"
    assert release_table.cell(key("0.30.0"), "0.19.0", spans["Fix A"]) == "upstream"
    assert release_table.cell(key("0.28.0"), "0.19.0", spans["Fix A"]) == "upstream"
    assert release_table.cell(key("0.19.0"), "0.20.0", None) == "-"
