"""The equivalence claims of make mutate (scripts/data/equivalent_*.toml)
are data: their shape is checked here, as a parser would check code. A claim
that matches nothing (a misspelt operator, a patch renamed) lets its mutant
count as a survivor again without a word."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from lib.paths import DEFAULT_SERIES
from lib.series import Patch, find_series
from prove import mutate, mutate_operators
from prove.mutate_operators import DATA, EXCLUDED_OPERATORS, VENV, claim_holds_on

OPERATORS, HUNKS = "equivalent_operators.toml", "equivalent_hunks.toml"
FIELDS = {
    OPERATORS: ("patch", "line", "operator", "why"),
    HUNKS: ("patch", "line", "why"),
}
# Cosmic Ray 8.7's core operators: the plain ones, and the three families
# named after the operator replaced and its replacement.
PLAIN = [
    "AddNot",
    "ReplaceTrueWithFalse",
    "ReplaceFalseWithTrue",
    "ReplaceAndWithOr",
    "ReplaceOrWithAnd",
    "ReplaceBreakWithContinue",
    "ReplaceContinueWithBreak",
    "ExceptionReplacer",
    "NumberReplacer",
    "RemoveDecorator",
    "ZeroIterationForLoop",
    "VariableReplacer",
    "VariableInserter",
]
OPERATOR = re.compile(
    rf"core/(?:{'|'.join(PLAIN)}"
    r"|Replace(?:Binary|Comparison|Unary)Operator_[A-Z][A-Za-z]*_[A-Z][A-Za-z]*)"
)


def claims(name: str) -> list[dict]:
    data = tomllib.loads((DATA / name).read_text())
    assert list(data) == ["claim"], f"{name}: only [[claim]] tables"
    return data["claim"]


def subjects() -> list[str]:
    """The subject of every patch in patches/ and patches/v*/."""
    files = [*DEFAULT_SERIES.glob("*.patch"), *DEFAULT_SERIES.glob("v*/*.patch")]
    return [Patch(f).subject() for f in files]


def cosmic_ray_operators() -> set[str] | None:
    """The operators Cosmic Ray defines, where it is installed: in this
    interpreter or in make mutate's venv (None where neither)."""
    if importlib.util.find_spec("cosmic_ray") is not None:
        from cosmic_ray.plugins import operator_names

        return set(operator_names())
    cli = VENV / "bin" / "cosmic-ray"
    if not cli.exists():
        return None
    proc = subprocess.run(
        [str(cli), "operators"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return set(proc.stdout.split())


@pytest.mark.parametrize("name", FIELDS)
def test_every_claim_has_exactly_its_fields_as_non_empty_strings(name):
    found = claims(name)
    assert found
    for n, claim in enumerate(found, 1):
        assert sorted(claim) == sorted(FIELDS[name]), f"{name} claim {n}: {claim}"
        for key, value in claim.items():
            assert isinstance(value, str), f"{name} claim {n}: {key}"
            assert value.strip(), f"{name} claim {n}: {key} is empty"
            # A folded string whose line lost its backslash keeps the newline.
            assert "\n" not in value, f"{name} claim {n}: {key} spans lines"
        assert claim["why"] == claim["why"].strip()
        assert "  " not in claim["why"], f"{name} claim {n}: why"


@pytest.mark.parametrize("name", FIELDS)
def test_no_claim_is_made_twice(name):
    keys = [tuple(c[f] for f in FIELDS[name] if f != "why") for c in claims(name)]
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == []


def test_an_operator_claim_names_the_line_stripped():
    lines = [c["line"] for c in claims(OPERATORS)]
    assert [x for x in lines if x != x.strip()] == []


def test_every_operator_is_one_cosmic_ray_makes_and_the_run_keeps():
    operators = {c["operator"] for c in claims(OPERATORS)}
    assert sorted(o for o in operators if not OPERATOR.fullmatch(o)) == []
    known = cosmic_ray_operators()
    if known is not None:
        assert len(known) > 100 and OPERATOR.fullmatch(min(known))
        assert sorted(operators - known) == []
    # A claim on an operator the run leaves out explains no mutant.
    dropped = re.compile("|".join(f"(:?{e})" for e in EXCLUDED_OPERATORS))
    assert sorted(o for o in operators if dropped.match(o)) == []


@pytest.mark.parametrize("name", FIELDS)
def test_every_claim_names_a_patch_in_patches(name):
    names = subjects()
    assert len(names) > 10
    stale = [
        c["patch"] for c in claims(name) if not any(c["patch"] in s for s in names)
    ]
    assert stale == []


@pytest.mark.parametrize("name", FIELDS)
def test_a_release_a_reason_names_has_a_series(name):
    """claim_holds_on reads a leading "0.20.2:": a release no series is on
    would turn its claim off everywhere."""
    releases = {s.base().version for s in find_series()}
    for claim in claims(name):
        named = re.match(r"(\d+\.\d+\.\d+):", claim["why"])
        if named:
            assert named[1] in releases, claim
            assert claim_holds_on(claim["why"], f"upstream/v{named[1]}")


def test_the_modules_load_the_files_in_order():
    """First match wins: the tables keep the files' order."""
    for module, name in [(mutate_operators, OPERATORS), (mutate, HUNKS)]:
        fields = FIELDS[name][:-1]
        assert list(module.EQUIVALENT.items()) == [
            (tuple(c[f] for f in fields), c["why"]) for c in claims(name)
        ]


def test_a_claim_with_a_field_missing_or_repeated_does_not_load(tmp_path):
    path = tmp_path / "claims.toml"
    good = '[[claim]]\npatch = "p"\nline = "x"\nwhy = "w"\n'
    assert mutate_operators.load_claims(_write(path, good), ("patch", "line")) == {
        ("p", "x"): "w"
    }
    with pytest.raises(mutate_operators.ForkError, match="claim 1 has patch, why"):
        mutate_operators.load_claims(
            _write(path, '[[claim]]\npatch = "p"\nwhy = "w"\n'), ("patch", "line")
        )
    with pytest.raises(mutate_operators.ForkError, match="claim 2 repeats"):
        mutate_operators.load_claims(_write(path, good + good), ("patch", "line"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
