#!/usr/bin/env python3
"""A stand-in for upstream vLLM's history, made from the release sdists.

    make standin                   # .work/upstream/standin.git

Upstream's repository is one `git clone` away on a machine with the
network; this one has the registries only. The releases the project carries
a series for (patches/ and patches/v<release>/), imported from their pinned
sdists as `make apply` imports them, become one linear history: a commit per
release in version order, each tagged v<release>, main at the newest. The
upstream tools take it where they take a clone of upstream
(`make upstream-cut UPSTREAM=.work/upstream/standin.git`, the default), so
they are proven offline. What it cannot show: the commits between two
releases. A bisection on it ends at a release's commit, which is what the
release matrix says too.

The commits have the tooling's identity and each release's import date, so
the same sdists give the same commit ids everywhere.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.fetch import ensure_base
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, WORK, rel
from lib.proc import git, run, tool_identity_env
from lib.series import Series, find_series, version_key

STANDIN = WORK / "upstream" / "standin.git"


def release_series(series_list: list[Series] | None = None) -> list[Series]:
    """One series per release, oldest first (the default series stands for
    its own base)."""
    by_version: dict[str, Series] = {}
    for s in series_list if series_list is not None else find_series():
        by_version.setdefault(s.base().version, s)
    return [by_version[v] for v in sorted(by_version, key=version_key)]


def build_standin(
    out: Path = STANDIN,
    series_list: list[Series] | None = None,
    cache: Path = CACHE,
) -> Path:
    """Write the stand-in history into the bare repository `out` (made anew)."""
    releases = release_series(series_list)
    if not releases:
        raise ForkError("no series found: nothing to build a history from")
    repos = {ensure_base(s.base(), s.base_file, cache) for s in releases}
    if out.exists():
        shutil.rmtree(out)
    # One copy of the import repository's packs (the releases delta well
    # against each other there), then a commit per release on top.
    (cache_repo,) = repos
    run(["git", "clone", "-q", "--bare", "--no-local", cache_repo, out])
    for ref in git(out, "for-each-ref", "--format=%(refname)").split():
        git(out, "update-ref", "-d", ref)
    parent: str | None = None
    previous = None
    for s in releases:
        base = s.base()
        imported = git(cache_repo, "rev-parse", f"{base.tag}^{{commit}}")
        date = git(out, "log", "-1", "--format=%ct +0000", imported)
        since = f" (the commits since {previous})" if previous else ""
        message = (
            f"vLLM {base.version}{since}\n\n"
            f"Stand-in history: the files of the {base.version} sdist "
            f"(sha256 {base.sdist_sha256 or base.git_commit}).\n"
        )
        args = ["commit-tree", f"{imported}^{{tree}}", "-m", message]
        if parent:
            args += ["-p", parent]
        parent = git(out, *args, env=tool_identity_env(date))
        git(out, "tag", f"v{base.version}", parent)
        say(f"    v{base.version} = {parent[:12]}")
        previous = base.version
    assert parent is not None
    git(out, "update-ref", "refs/heads/main", parent)
    # The import repository has no branch: a clone must check main out.
    git(out, "symbolic-ref", "HEAD", "refs/heads/main")
    return out


def upstream_or_standin(upstream: str | None) -> str:
    """The history a command reads: the clone or URL given (UPSTREAM=), or
    the stand-in, built on first use."""
    if upstream:
        return upstream
    if not STANDIN.exists():
        step("no UPSTREAM given: building the stand-in history first")
        build_standin()
    return str(STANDIN)


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--out",
        type=Path,
        default=STANDIN,
        help=f"bare repository (default: {rel(STANDIN)})",
    )
    args = p.parse_args()
    step(f"stand-in history of the releases the project carries, into {rel(args.out)}")
    out = build_standin(args.out.resolve())
    count = git(out, "rev-list", "--count", "main")
    say(f"{count} release commits on main; tags v<release>")
    return 0


if __name__ == "__main__":
    main_guard(main)
