"""make mutate's semantic mutants (scripts/data/semantic_mutants.toml) are
data that must move with the patches: each names one patch of a series that
exists, and each text it replaces is in that series' patched tree exactly
once, checked here on trees built from patches/ as make mutate builds them
(scratch trees: seconds each). A stale text would otherwise stop make
mutate an hour into a run, or, found twice, mutate the wrong place."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

from keep.apply import scratch_tree
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES
from lib.series import Series, find_series
from prove import mutate
from prove.mutate import code_of
from prove.mutate_semantic import (
    Edit,
    SemanticMutant,
    load_semantic,
    mutated_text,
    semantic_of,
)

MUTANTS = load_semantic()
RELEASES = sorted({m.release for m in MUTANTS})


def series_of(release: str) -> Series:
    (series,) = [s for s in find_series() if s.base().version == release]
    return series


@pytest.fixture(scope="session")
def trees(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The patched tree of each release the mutants name (the default
    series' is conftest's `tree`)."""
    out = {}
    for release in RELEASES:
        series = series_of(release)
        if series.dir == DEFAULT_SERIES:
            out[release] = tree
        else:
            dest = tmp_path_factory.mktemp(f"tree-{release}") / "vllm"
            out[release] = scratch_tree(series, dest)
    return out


def test_at_least_30_mutants_on_the_default_and_the_newest_series():
    assert len(MUTANTS) >= 30
    assert {"0.20.2", "0.33.0"} <= set(RELEASES)
    per_patch = Counter((m.release, m.patch) for m in MUTANTS)
    # Spread over the patches, not piled on one.
    assert len(per_patch) >= 12
    assert max(per_patch.values()) <= len(MUTANTS) // 4


def test_every_mutant_names_one_patch_of_its_series():
    for release in RELEASES:
        subjects = [p.subject() for p in series_of(release).patches()]
        mine = semantic_of(release, subjects, None)
        assert mine and all(m.patch in subjects for m in mine)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.release}-{m.id}")
def test_each_text_is_in_its_tree_once_and_the_mutant_changes_code(mutant, trees):
    before = (trees[mutant.release] / mutant.file).read_text()
    after = mutated_text(mutant, before)
    ast.parse(after)  # still Python: a mutant that cannot import is no bug
    assert code_of(after) != code_of(before), "comments or docstrings only"


def test_each_field_is_a_non_empty_one_line_reason():
    for m in MUTANTS:
        assert re.fullmatch(r"\d{4}-[a-z0-9-]+", m.id), m.id
        assert m.why.strip() and "\n" not in m.why and "  " not in m.why, m.id
        assert "\n" not in m.equivalent, m.id


def test_every_record_and_wait_event_call_0005_writes_has_mutants():
    """Issue 27: each compute-done `record` and each `wait_event` the
    ordering patch adds must be broken by a mutant (dropped, moved, on the
    wrong stream or event)."""
    (patch,) = DEFAULT_SERIES.glob("0005-*.patch")
    calls = {
        line[1:].strip()
        for line in patch.read_text().splitlines()
        if line.startswith("+") and re.search(r"\.(record|wait_event)\(", line)
    }
    assert calls
    found = "\n".join(e.find for m in MUTANTS if m.release == "0.20.2" for e in m.edits)
    assert sorted(c for c in calls if c not in found) == []
    breaking = [m for m in MUTANTS if m.id.startswith("0005-")]
    assert len(breaking) >= 5


def mutant(*edits: tuple[str, str]) -> SemanticMutant:
    return SemanticMutant(
        "0001-x", "0.20.2", "p", "m.py", [Edit(f, r) for f, r in edits], "why"
    )


def test_a_text_not_found_or_found_twice_is_an_error_naming_the_mutant():
    assert mutated_text(mutant(("b = 2", "b = 3")), "a = 1\nb = 2\n") == (
        "a = 1\nb = 3\n"
    )
    with pytest.raises(ForkError, match="0001-x: its text is not found"):
        mutated_text(mutant(("c = 3", "c = 4")), "a = 1\n")
    with pytest.raises(ForkError, match="0001-x: its text is found 2 times"):
        mutated_text(mutant(("a", "b")), "a = 1\na = 2\n")
    # A second edit is checked on the text the first one left.
    with pytest.raises(ForkError, match="not found"):
        mutated_text(mutant(("a = 1", "x = 1"), ("a = 1", "y")), "a = 1\n")


def test_a_malformed_mutant_does_not_load(tmp_path):
    good = (
        '[[mutant]]\nid = "0001-x"\nrelease = "0.20.2"\npatch = "p"\n'
        'file = "m.py"\nfind = "a"\nreplace = "b"\nwhy = "w"\n'
    )
    path = tmp_path / "m.toml"
    path.write_text(good)
    assert [m.id for m in load_semantic(path)] == ["0001-x"]
    for bad, message in [
        (good.replace('why = "w"\n', ""), "needs"),
        (good + 'typo = "x"\n', "needs"),
        (good.replace('replace = "b"', 'replace = "a"'), "no change"),
        (good + good, "has the id"),
        (good + '[[mutant.also]]\nfind = "c"\n', "find and replace"),
    ]:
        path.write_text(bad)
        with pytest.raises(ForkError, match=message):
            load_semantic(path)


def test_the_semantic_kind_is_a_kind_of_make_mutate():
    assert "semantic" in mutate.KINDS
