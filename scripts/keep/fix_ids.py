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
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.release_table import release_patches
from lib.cli import main_guard, parser
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


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--version", metavar="RELEASE", help="only this release's series")
    args = p.parse_args()
    all_series = find_series()
    ids = fix_ids(all_series)
    chosen = [series_for_version(args.version)] if args.version else all_series
    for s in sorted(chosen, key=lambda s: version_key(s.base().version)):
        print(f"{s.base().version} ({rel(s.dir)}/):")
        for patch, fix in zip(s.patches(), series_fix_ids(s, ids), strict=True):
            print(f"  {patch.name}  fix {fix}")
    return 0


if __name__ == "__main__":
    main_guard(main)
