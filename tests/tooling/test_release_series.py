"""One series per release: which one a VERSION= picks, which ones make test
runs in full, make test-releases' table, and the README's table of what
each release carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keep import release_table
from lib import series as series_module
from lib.errors import ForkError
from lib.paths import ROOT
from lib.series import Series, default_and_newest, find_series, series_for_version
from prove import test_releases


def make_series(d: Path, version: str, subjects: list[str]) -> Series:
    d.mkdir(parents=True, exist_ok=True)
    sha = "0" * 64
    (d / "base.toml").write_text(
        f'version = "{version}"\nsdist_url = "u"\nsdist_sha256 = "{sha}"\n'
    )
    for i, subject in enumerate(subjects, 1):
        (d / f"{i:04d}-{subject.replace(' ', '-')}.patch").write_text(
            f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] {subject}\n\n"
            "Body.\n\nReproducer: tests/reproducers/test_x.py::test_x\n---\n"
        )
    return Series(d)


@pytest.fixture
def patches(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "patches"
    make_series(root, "0.20.2", ["Fix one", "Fix two", "Fix three"])
    make_series(root / "v0.19.0", "0.19.0", ["Fix one", "Fix two", "Fix three"])
    make_series(root / "v0.24.0", "0.24.0", ["Fix one", "Fix three"])
    make_series(root / "v0.100.0", "0.100.0", ["Fix three"])
    monkeypatch.setattr(series_module, "DEFAULT_SERIES", root)
    return root


def test_a_version_picks_its_series(patches):
    assert series_for_version("0.20.2").dir == patches
    assert series_for_version("0.24.0").dir == patches / "v0.24.0"
    with pytest.raises(ForkError) as info:
        series_for_version("0.28.0")
    msg = str(info.value)
    assert "no series for vLLM 0.28.0" in msg
    assert "0.19.0, 0.24.0, 0.100.0" in msg  # the ones there are, by version
    assert "make rebase BASE=0.28.0" in msg


def test_make_test_runs_the_default_and_the_newest_series(patches):
    full, rest = default_and_newest(find_series())
    assert [s.base().version for s in full] == ["0.20.2", "0.100.0"]
    assert sorted(s.base().version for s in rest) == ["0.19.0", "0.24.0"]
    only = [Series(patches)]
    assert default_and_newest(only) == (only, [])


def test_the_release_table_names_each_patch_by_its_default_number(patches):
    text = release_table.table()
    rows = text.splitlines()
    assert rows[0] == "| release | series | 0001 | 0002 | 0003 |"
    assert (
        rows[2] == "| 0.19.0 | `" + str(patches / "v0.19.0") + "/` | yes | yes | yes |"
    )
    assert rows[4].startswith("| 0.24.0 |")
    assert rows[4].endswith("| yes | upstream | yes |")
    assert rows[5].endswith("| upstream | upstream | yes |")  # 0.100.0, last


def test_a_release_s_own_patch_gets_a_column_of_its_own(patches):
    # A fix of a bug only later releases have (the default release lacks
    # it): labelled R1, from the oldest release that carries it.
    make_series(patches / "v0.25.0", "0.25.0", ["Fix one", "Something else"])
    make_series(patches / "v0.26.0", "0.26.0", ["Something else"])
    rows = release_table.table().splitlines()
    assert rows[0] == "| release | series | 0001 | 0002 | 0003 | R1 |"
    assert rows[2].endswith("| yes | yes | yes | - |")  # 0.19.0
    assert rows[5].endswith("| yes | upstream | upstream | yes |")  # 0.25.0
    assert rows[-1] == "R1: Something else"
    assert release_table.carried(Series(patches), Series(patches / "v0.26.0")) == ["R1"]


def test_the_readme_table_is_the_committed_series():
    readme = (ROOT / "README.md").read_text()
    start = readme.index(release_table.BEGIN) + len(release_table.BEGIN)
    end = readme.index(release_table.END)
    assert readme[start:end].strip() == release_table.table().strip(), (
        "README.md's release table is stale: paste `python3 "
        "scripts/keep/release_table.py` between its markers"
    )


def test_test_releases_goes_on_past_a_failure_and_tables_every_release(
    patches, tmp_path
):
    def fake(series: Series, is_default: bool) -> test_releases.Row:
        version = series.base().version
        bad = version == "0.24.0"
        return test_releases.Row(
            release=version,
            series=str(series.dir),
            patches=test_releases.patch_numbers(series),
            reproducers="3 reproducer tests of 3 patches",
            upstream="base 10 passed, series 10 passed, 0 newly failing",
            environment=".venv" if is_default else ".work/venvs/x",
            seconds=1.0,
            ok=not bad,
            problems=["boom"] if bad else [],
        )

    chosen = sorted(
        find_series(), key=lambda s: series_module.version_key(s.base().version)
    )
    rows = test_releases.run(chosen, Series(patches), fake, out=tmp_path / "out")
    assert [(r.release, r.ok) for r in rows] == [
        ("0.19.0", True),
        ("0.20.2", True),
        ("0.24.0", False),
        ("0.100.0", True),
    ]
    assert [r.environment for r in rows][1] == ".venv"
    md = (tmp_path / "out" / "releases.md").read_text().splitlines()
    assert len(md) == 2 + 4
    # Patches by their number in the default series: 0.24.0 has 1 and 3.
    assert md[4].startswith("| 0.24.0 | FAIL | 2: 0001 0003 |")
    data = json.loads((tmp_path / "out" / "releases.json").read_text())
    assert data[2]["problems"] == ["boom"]


def test_upstream_summary_reads_run_tests_detail():
    detail = (
        "base: 293 passed, 43 failed, 2 errors, 1 skipped\n"
        "series: 297 passed, 52 failed, 2 errors, 1 skipped\n"
        "9 newly failing:\n  tests/v1/core/test_x.py::test_y"
    )
    assert test_releases.upstream_summary(detail) == (
        "base 293 passed, series 297 passed, 9 newly failing"
    )


def test_releases_are_ordered_with_pre_releases_below_the_final(patches):
    from lib.series import version_key as key

    assert key("0.34.0rc1") < key("0.34.0") < key("0.34.0.post1")
    assert key("0.34.0.dev0") < key("0.34.0") < key("0.100.0")
    assert series_for_version("v0.24.0").dir == patches / "v0.24.0"


def test_a_release_whose_check_breaks_is_a_failed_row(patches, monkeypatch):
    def broken(series):
        raise ForkError("the sdist's checksum does not match")

    monkeypatch.setattr(test_releases, "prepare", broken)
    row = test_releases.prove(Series(patches / "v0.24.0"), False)
    assert (row.release, row.ok) == ("0.24.0", False)
    assert row.problems == ["the sdist's checksum does not match"]


def test_the_ledger_probes_judge_the_series_by_each_named_test(monkeypatch, tmp_path):
    """A probe id names one test or every parametrization of it; a test any
    of whose cases fails, or that is not run, with the series fails the
    step, naming the cases and the make command that reruns it. Only the
    series tree is run."""
    from types import SimpleNamespace

    from keep import ledger
    from prove import run_tests

    ids = ["tests/a.py::test_one", "tests/a.py::test_two[x]", "tests/b.py::test_t"]
    monkeypatch.setattr(ledger, "probe_tests", lambda bugs: ids)
    monkeypatch.setattr(ledger, "load", lambda: [])
    monkeypatch.setattr(run_tests, "LOGS", tmp_path)
    outcomes = {
        "tests/a.py::test_one[p]": "passed",
        "tests/a.py::test_one[q]": "failed",
        "tests/a.py::test_two[x]": "passed",
        # A longer name is another test, not a parametrization.
        "tests/b.py::test_t_other": "passed",
    }
    trees_run = []

    def fake_pytest(python, tree, cwd, junit, args, log):
        trees_run.append(tree)
        return 0

    monkeypatch.setattr(run_tests, "run_pytest", fake_pytest)
    monkeypatch.setattr(run_tests, "read_junit", lambda junit: outcomes)
    trees = SimpleNamespace(version="9.9", patched=Path("series"))
    ok, detail = run_tests.ledger_probes(Path("py"), trees)
    assert not ok and trees_run == [Path("series")]
    assert "rerun: make test-releases VERSION=9.9" in detail.splitlines()[0]
    assert detail.splitlines()[1:] == [
        "  tests/a.py::test_one: test_one[q] failed with the series",
        "  tests/b.py::test_t: not run with the series",
    ]
    outcomes["tests/a.py::test_one[q]"] = "skipped"
    outcomes["tests/b.py::test_t"] = "passed"
    assert run_tests.ledger_probes(Path("py"), trees) == (
        True,
        "3 ledger probes pass with the series",
    )


def test_a_probe_id_whose_parameters_cannot_be_read_is_refused():
    from keep import ledger

    bug = SimpleBug(probe="tests/a.py::test_x[a b] and tests/a.py::test_y[ok]")
    with pytest.raises(ForkError, match=r"row: tests/a.py::test_x\.\.\."):
        ledger.probe_tests([bug])
    assert ledger.probe_tests([SimpleBug(probe="tests/a.py::test_y[ok-1.5]")]) == [
        "tests/a.py::test_y[ok-1.5]"
    ]


class SimpleBug:
    """A ledger row with only what probe_tests reads."""

    def __init__(self, probe: str):
        self.id = "row"
        self.probe = probe
