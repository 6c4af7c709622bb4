#!/usr/bin/env python3
"""The README's table of which patches each release's series carries.

Patches are named by their number in the default series (patches/, on
0.20.2), matched by subject: a series for another release renumbers the
patches it keeps (0006 is 0003 on 0.33.0). A release whose series lacks a
patch has it upstream there (REBASE.md of that series says why).

  python3 scripts/release_table.py     prints the table
"""

from __future__ import annotations

import sys

from common import DEFAULT_SERIES, ForkError, main_guard, parser, rel
from series import Series, find_series, version_key

BEGIN = "<!-- release table: scripts/release_table.py writes this -->"
END = "<!-- end of release table -->"


def carried(default: Series, series: Series) -> list[str]:
    """The default series' numbers of the patches `series` carries."""
    numbers = {p.subject(): p.name[:4] for p in default.patches()}
    found = []
    for p in series.patches():
        if p.subject() not in numbers:
            raise ForkError(
                f"{rel(p.path)}: its subject is no patch of {rel(default.dir)}/ "
                "(a series for a release descends from the default one)"
            )
        found.append(numbers[p.subject()])
    return found


def table(all_series: list[Series] | None = None) -> str:
    all_series = all_series or find_series()
    default = all_series[0]
    numbers = [p.name[:4] for p in default.patches()]
    rows = sorted(all_series, key=lambda s: version_key(s.base().version))
    lines = [
        "| release | series | " + " | ".join(numbers) + " |",
        "| --- | --- |" + " :-: |" * len(numbers),
    ]
    for s in rows:
        have = set(carried(default, s))
        where = rel(s.dir) + "/"
        cells = ["yes" if n in have else "upstream" for n in numbers]
        lines.append(f"| {s.base().version} | `{where}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser(__doc__).parse_args()
    if not (DEFAULT_SERIES / "base.toml").is_file():
        raise ForkError(f"{rel(DEFAULT_SERIES)}/base.toml not found")
    sys.stdout.write(table() + "\n")
    return 0


if __name__ == "__main__":
    main_guard(main)
