#!/usr/bin/env python3
"""One name per fix across releases: its fix id.

Each release's series numbers its patches 0001, 0002, ... anew, so a file's
number says nothing across releases (0.28.0's 0003 is the fix the README
calls 0004). The fix id is the name the README's release table, the ledger
and `make apply`'s progress lines use: the patch's number in the default
series (patches/, on 0.20.2), or R1, R2, ... for a fix only other releases
carry (release_table.release_patches). A patch is matched by its subject,
which a rebase keeps; nothing is stored but the patches themselves.

  python3 scripts/keep/fix_ids.py                   each release's files, their fix ids
  python3 scripts/keep/fix_ids.py --version 0.28.0  one release's
  python3 scripts/keep/fix_ids.py --write-rebase-notes
      the `fix` column of every REBASE.md table that names patch files
      (tests/tooling/test_rebase_notes.py checks it is up to date)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.release_table import release_patches
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import rel
from lib.series import Patch, Series, find_series, series_for_version, version_key


def fix_ids(all_series: list[Series] | None = None) -> dict[str, str]:
    """Subject -> fix id, over every series (the default one first)."""
    all_series = all_series or find_series()
    default = all_series[0]
    ids = {p.subject(): p.name[:4] for p in default.patches()}
    ids.update(release_patches(default, all_series))
    return ids


def series_fix_ids(series: Series, ids: dict[str, str] | None = None) -> list[str]:
    """The fix id of each patch of `series`, in order; refused when a patch
    has none or two patches share one."""
    ids = fix_ids() if ids is None else ids
    found = []
    for p in series.patches():
        if p.subject() not in ids:
            raise ForkError(
                f"{rel(p.path)}: its subject is no patch of the default series "
                "nor of another release's series, so it has no fix id"
            )
        found.append(ids[p.subject()])
    twice = sorted({i for i in found if found.count(i) > 1})
    if twice:
        raise ForkError(f"{rel(series.dir)}/: two patches are fix {', '.join(twice)}")
    return found


def progress_label(patch: Patch, ids: dict[str, str]) -> str:
    """What `make apply` prints after a patch's file name: its fix id when
    the series' file number is another (nothing for a patch with no id)."""
    fix = ids.get(patch.subject())
    return f"  (fix {fix})" if fix and fix != patch.name[:4] else ""


def apply_labels() -> dict[str, str]:
    """fix_ids() for `make apply`, which must not fail over a label."""
    try:
        return fix_ids()
    except (ForkError, OSError):
        return {}


# The REBASE.md tables that name patch files (`make rebase` writes the
# first, the second is added by hand), and the column of the file whose fix
# id goes in their last column, `fix`: the file the patch is now, or, for a
# patch the rebase dropped, the file it was.
NOTE_TABLES = {
    ("patch", "state", "detail", "now"): (3, 0),
    ("patch", "subject", "how"): (0, 0),
}
FIX_COLUMN = "fix"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def slug_ids(all_series: list[Series], ids: dict[str, str]) -> dict[str, str]:
    """File name without its number (the subject's slug, the same in every
    series) -> fix id, over every series: names a dropped patch's file."""
    return {
        p.name[5:]: ids[p.subject()]
        for s in all_series
        for p in s.patches()
        if p.subject() in ids
    }


def with_fix_ids(text: str, series: Series, ids: dict[str, str], slugs: dict) -> str:
    """REBASE.md `text` of `series` with the fix column of its patch tables
    (re)made; refused when a file it names has no fix id."""
    here = {p.name: ids.get(p.subject()) for p in series.patches()}
    out: list[str] = []
    columns: tuple[int, int] | None = None
    header: tuple[str, ...] = ()
    for line in text.splitlines():
        cells = _cells(line) if line.startswith("|") else None
        if cells is None:
            columns = None
        elif columns is None:
            header = tuple(c for c in cells if c != FIX_COLUMN)
            if header in NOTE_TABLES:
                columns = NOTE_TABLES[header]
                line = _row([*header, FIX_COLUMN])
        elif set(cells) <= {"---", ":-:"}:
            line = _row(["---"] * (len(header) + 1))
        else:
            now, was = columns
            cells = cells[: len(header)]
            name = cells[now] if cells[now] != "dropped" else cells[was]
            fix = here.get(name) or slugs.get(name[5:])
            if not fix:
                raise ForkError(
                    f"{rel(series.dir)}/REBASE.md names {name}, which has no fix "
                    "id (no series has a patch of that name)"
                )
            line = _row([*cells, fix])
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def rebase_notes(
    all_series: list[Series], write: bool, only: Path | None = None
) -> list[Series]:
    """The series (of `only`'s directory, if given) whose REBASE.md lacks
    its fix ids; rewritten with `write`."""
    ids = fix_ids(all_series)
    slugs = slug_ids(all_series, ids)
    stale = []
    for s in all_series:
        if only is not None and s.dir.resolve() != only.resolve():
            continue
        note = s.dir / "REBASE.md"
        if not note.is_file():
            continue
        text = note.read_text()
        new = with_fix_ids(text, s, ids, slugs)
        if new != text:
            stale.append(s)
            if write:
                note.write_text(new)
    return stale


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--version", metavar="RELEASE", help="only this release's series")
    p.add_argument(
        "--write-rebase-notes",
        action="store_true",
        help="write the fix column of each series' REBASE.md tables",
    )
    args = p.parse_args()
    all_series = find_series()
    if args.write_rebase_notes:
        for s in rebase_notes(all_series, write=True):
            say(f"{rel(s.dir)}/REBASE.md: fix ids written")
        return 0
    ids = fix_ids(all_series)
    chosen = [series_for_version(args.version)] if args.version else all_series
    for s in sorted(chosen, key=lambda s: version_key(s.base().version)):
        print(f"{s.base().version} ({rel(s.dir)}/):")
        for patch, fix in zip(s.patches(), series_fix_ids(s, ids), strict=True):
            print(f"  {patch.name}  fix {fix}")
    return 0


if __name__ == "__main__":
    main_guard(main)
