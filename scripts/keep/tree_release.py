#!/usr/bin/env python3
"""Which release and series a tree holds: what it was built from.

`make apply` records them in the tree's overlay commit (the trailers
Series-Release, Series-Dir and Series-Fingerprint); a build cut short
records them in its marker (keep/interrupted.py), so a half-built tree
still says what it was becoming. Trees built before the trailers existed
are read from their branch (fork/v<release>) or from the upstream release
their history starts from.

The Makefile asks this script which series a target means when VERSION=
is not given (--pick prints --version <release> or --series <dir>), so
that choosing a release once, with `make apply VERSION=0.28.0`, holds for
install, refresh, wheel, overlay and image until another is chosen.
Without --pick it says what the tree holds.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.interrupted import read_marker
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, DEFAULT_TREE, ROOT, rel
from lib.proc import git, git_ok
from lib.series import BASE_FILE, Series, read_base, series_for_version
from lib.venv import VENV, installed

OVERLAY_SUBJECT = "fork: overlay"
FINGERPRINT_TRAILER = "Series-Fingerprint"
RELEASE_TRAILER = "Series-Release"
DIR_TRAILER = "Series-Dir"
# How far back from HEAD to look for the overlay commit: past the commits a
# user adds on top of a build, never further than the series is long.
HISTORY_LIMIT = 200


@dataclass(frozen=True)
class Holding:
    """What a tree was built from."""

    release: str
    series_dir: str | None = None  # as recorded: relative to the root
    fingerprint: str | None = None
    # False while the tree is half-built (an interrupted `make apply`).
    complete: bool = True

    def describe(self) -> str:
        where = f" ({self.series_dir}/)" if self.series_dir else ""
        state = "" if self.complete else ", an interrupted build"
        return f"{self.release}{where}{state}"


def trailers(message: str) -> dict[str, str]:
    found = {}
    for line in message.splitlines():
        m = re.match(r"^([A-Za-z-]+): (.+)$", line.strip())
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def overlay_trailers(tree: Path, ref: str = "HEAD") -> dict[str, str] | None:
    """The trailers of the newest overlay commit in `ref`'s history."""
    out = git(
        tree,
        "log",
        "--first-parent",
        f"-n{HISTORY_LIMIT}",
        "--format=%B%x00",
        ref,
        check=False,
    )
    for message in out.split("\0"):
        if message.strip().startswith(OVERLAY_SUBJECT):
            return trailers(message)
    return None


def release_from_history(tree: Path, ref: str = "HEAD") -> str | None:
    """The release of the upstream commit `ref` is built on."""
    if ref == "HEAD":
        branch = git(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False)
        if m := re.fullmatch(r"fork/v(.+)", branch):
            return m.group(1)
    refs = git(
        tree,
        "for-each-ref",
        "--format=%(refname)",
        "refs/remotes/upstream/",
        check=False,
    )
    for upstream in refs.split():
        if git_ok(tree, "merge-base", "--is-ancestor", upstream, ref):
            return upstream.rsplit("/v", 1)[-1]
    return None


def tree_holds(tree: Path = DEFAULT_TREE) -> Holding | None:
    """What `tree` holds, or None (no tree, or not one `make apply` built)."""
    if not (tree / ".git").exists():
        return None
    marker = read_marker(tree)
    if marker:
        return Holding(marker.get("release", "?"), marker.get("series"), None, False)
    if not git_ok(tree, "rev-parse", "-q", "--verify", "HEAD"):
        return None
    found = overlay_trailers(tree) or {}
    release = found.get(RELEASE_TRAILER) or release_from_history(tree)
    if not release:
        return None
    return Holding(release, found.get(DIR_TRAILER), found.get(FINGERPRINT_TRAILER))


def series_recorded_at(tree: Path, ref: str) -> Series | None:
    """The series the build `ref` stands on records, if it is still there."""
    found = overlay_trailers(tree, ref) or {}
    if RELEASE_TRAILER not in found:
        return None
    return recorded_series(Holding(found[RELEASE_TRAILER], found.get(DIR_TRAILER)))


def recorded_series(holding: Holding) -> Series | None:
    """The series directory the tree records, if it is still there and
    still serves the same release."""
    if not holding.series_dir:
        return None
    path = Path(holding.series_dir)
    path = path if path.is_absolute() else ROOT / path
    try:
        if read_base(path / BASE_FILE).version == holding.release:
            return Series(path.resolve())
    except ForkError:
        pass
    return None


def pick_arguments(tree: Path = DEFAULT_TREE) -> list[str]:
    """The --version/--series arguments that pick the series `tree` holds;
    the default series when the tree holds none the project knows."""
    default = ["--series", rel(DEFAULT_SERIES)]
    holding = tree_holds(tree)
    if holding is None or holding.release == "?":
        return default
    try:
        standard = series_for_version(holding.release)
    except ForkError:
        standard = None
    recorded = recorded_series(holding)
    if recorded and (standard is None or recorded.dir != standard.dir.resolve()):
        return ["--series", rel(recorded.dir)]
    if standard is not None:
        return ["--version", holding.release]
    return default


def announce_choice(series: Series, doing: str, tree: Path = DEFAULT_TREE) -> None:
    """Say so when a command acts on another release than the tree holds:
    the operator chose it, and should see that it differs."""
    holding = tree_holds(tree)
    version = series.base().version
    if holding and holding.release != version:
        say(f"{rel(tree)}/ holds {holding.release}; {doing} {version} as asked")


def stale_install(tree: Path = DEFAULT_TREE, venv: Path = VENV) -> str | None:
    """A line to print when `venv` has `tree` installed editable under an
    older build's version: the code that runs is the tree's, what pip show
    and vllm.__version__ say is the install's (make install sets it)."""
    found = installed("vllm", venv)
    holding = tree_holds(tree)
    if not found or not holding or not holding.fingerprint:
        return None
    version, source = found
    if source is None or source.resolve() != tree.resolve():
        return None
    if version.startswith(f"{holding.release}+") and (
        f".g{holding.fingerprint[:8]}" in version
    ):
        return None
    again = "make install" + (
        "" if tree.resolve() == DEFAULT_TREE.resolve() else f" TREE={rel(tree)}"
    )
    return (
        f"note: {rel(venv)} has {rel(tree)}/ installed as vllm {version}, an older "
        f"build; it runs the code of {holding.release} now, and `{again}` makes "
        "pip show and vllm.__version__ say so"
    )


def main() -> int:
    p = parser(__doc__, tree="the tree to read")
    p.add_argument(
        "--pick",
        action="store_true",
        help="print the --version/--series arguments that pick the tree's "
        "series (the Makefile's default when VERSION= is not given)",
    )
    args = p.parse_args()
    tree = args.tree.resolve()
    if args.pick:
        try:
            print(" ".join(pick_arguments(tree)))
        except Exception:  # noqa: BLE001 - make must still get the default
            print(" ".join(["--series", rel(DEFAULT_SERIES)]))
        return 0
    holding = tree_holds(tree)
    if holding is None:
        raise ForkError(f"{rel(tree)}/ holds no tree built by `make apply`")
    say(f"{rel(tree)}/ holds {holding.describe()}")
    say("  make targets pick: " + " ".join(pick_arguments(tree)))
    return 0


if __name__ == "__main__":
    main_guard(main)
