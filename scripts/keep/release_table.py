#!/usr/bin/env python3
"""The README's table of which patches each release's series carries.

Patches are named by their number in the default series (patches/, on
0.20.2), matched by subject: a series for another release renumbers the
patches it keeps (0006 is 0003 on 0.33.0). A release whose series lacks a
patch has it upstream there (REBASE.md of that series says why), or, where
the ledger (scripts/data/ledger.toml) says the bug starts in a later
release, never had the bug: '-'.

  python3 scripts/keep/release_table.py  prints the table
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, ROOT, rel
from lib.series import Series, find_series, version_key

LEDGER = ROOT / "scripts" / "data" / "ledger.toml"
# The R labels given for good (release_patches).
FIX_IDS = ROOT / "scripts" / "data" / "fix_ids.toml"
BEGIN = "<!-- release table: scripts/keep/release_table.py writes this -->"
END = "<!-- end of release table -->"


def carried(
    default: Series, series: Series, extra: dict[str, str] | None = None
) -> list[str]:
    """The default series' numbers of the patches `series` carries; a patch
    of this release's own (a fix of a bug the default release does not
    have) by its label in `extra` (default: `release_patches`)."""
    numbers = {p.subject(): p.name[:4] for p in default.patches()}
    if extra is None:
        extra = release_patches(default, find_series())
    found = []
    for p in series.patches():
        label = numbers.get(p.subject()) or extra.get(p.subject())
        if label is None:
            raise ForkError(
                f"{rel(p.path)}: its subject is no patch of {rel(default.dir)}/ "
                "nor of another release's series"
            )
        found.append(label)
    return found


def pinned_fix_ids(path: Path = FIX_IDS) -> dict[str, str]:
    """Subject -> R label of every fix that has one for good (FIX_IDS)."""
    if not path.is_file():
        return {}
    return dict(tomllib.loads(path.read_text()).get("pinned", {}))


def release_patches(
    default: Series, all_series: list[Series], pinned: dict[str, str] | None = None
) -> dict[str, str]:
    """Patches that only other releases' series carry (upstream has a bug
    there that the default release lacks), by subject: labelled R1, R2, ...
    An id once given is kept (`pinned`, default FIX_IDS), so that a fix
    added later on an older release does not renumber the others; a fix not
    pinned yet takes the next number, in the order of the oldest release
    that carries it. Ordered by label."""
    pinned = pinned_fix_ids() if pinned is None else pinned
    numbers = {p.subject() for p in default.patches()}
    subjects = {p.subject() for s in all_series for p in s.patches()}
    labels: dict[str, str] = {}
    # The numbers of the pinned fixes these series carry are taken.
    taken = {int(label[1:]) for s, label in pinned.items() if s in subjects}
    for s in sorted(all_series, key=lambda s: version_key(s.base().version)):
        for p in s.patches():
            subject = p.subject()
            if subject in numbers or subject in labels:
                continue
            if subject in pinned:
                labels[subject] = pinned[subject]
            else:
                taken.add(n := max(taken, default=0) + 1)
                labels[subject] = f"R{n}"
    return dict(sorted(labels.items(), key=lambda item: int(item[1][1:])))


def first_affected(ledger: Path = LEDGER) -> dict[str, str]:
    """The first release each carried patch's bug is in, by the patch's
    subject: the earliest start of the ledger rows it carries. Read from the
    data file, not through keep.ledger, which imports this module."""
    if not ledger.is_file():
        return {}
    first: dict[str, str] = {}
    for row in tomllib.loads(ledger.read_text()).get("bug", []):
        subject, span = row.get("patch"), row.get("affected")
        if row.get("verdict") != "carried" or not subject or not span:
            continue
        if subject not in first or version_key(span[0]) < version_key(first[subject]):
            first[subject] = span[0]
    return first


def still_open(ledger: Path = LEDGER) -> dict[str, tuple[str, str]]:
    """Per carried patch's subject, the last release its carried rows reach
    and the release upstream fixed it in (empty: none): a release between
    the two has the bug, and its series does not carry the fix ('open')."""
    if not ledger.is_file():
        return {}
    spans: dict[str, tuple[str, str]] = {}
    for row in tomllib.loads(ledger.read_text()).get("bug", []):
        subject, span = row.get("patch"), row.get("affected")
        if row.get("verdict") != "carried" or not subject or not span:
            continue
        end, fixed = spans.get(subject, (span[1], row.get("fixed_in", "")))
        if version_key(span[1]) >= version_key(end):
            end, fixed = span[1], row.get("fixed_in", "")
        spans[subject] = (end, fixed)
    return spans


def cell(version: tuple, start: str | None, span: tuple[str, str] | None) -> str:
    """A default-series patch that `version`'s series does not carry."""
    if start and version < version_key(start):
        return "-"
    if span and version > version_key(span[0]):
        fixed = span[1]
        if not fixed or version < version_key(fixed):
            return "open"
    return "upstream"


def table(all_series: list[Series] | None = None) -> str:
    all_series = all_series or find_series()
    default = all_series[0]
    numbers = [p.name[:4] for p in default.patches()]
    extra = release_patches(default, all_series)
    rows = sorted(all_series, key=lambda s: version_key(s.base().version))
    lines = [
        "| release | series | " + " | ".join([*numbers, *extra.values()]) + " |",
        "| --- | --- |" + " :-: |" * (len(numbers) + len(extra)),
    ]
    starts, spans = first_affected(), still_open()
    start_of = {p.name[:4]: starts.get(p.subject()) for p in default.patches()}
    span_of = {p.name[:4]: spans.get(p.subject()) for p in default.patches()}
    for s in rows:
        have = set(carried(default, s, extra))
        where = rel(s.dir) + "/"
        version = version_key(s.base().version)
        cells = [
            "yes" if n in have else cell(version, start_of[n], span_of[n])
            for n in numbers
        ]
        cells += ["yes" if n in have else "-" for n in extra.values()]
        lines.append(f"| {s.base().version} | `{where}` | " + " | ".join(cells) + " |")
    if extra:
        lines.append("")
        lines += [f"{label}: {subject}" for subject, label in extra.items()]
    return "\n".join(lines)


def main() -> int:
    parser(__doc__).parse_args()
    if not (DEFAULT_SERIES / "base.toml").is_file():
        raise ForkError(f"{rel(DEFAULT_SERIES)}/base.toml not found")
    sys.stdout.write(table() + "\n")
    return 0


if __name__ == "__main__":
    main_guard(main)
