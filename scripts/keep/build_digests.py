"""The build digests: what `python -m vllm._fork` checks the installed files against.

`make apply` writes `vllm/_fork_digests.json` into the overlay commit, next
to the overlay's `vllm/_fork.py`: the release, the series (its directory,
the make variable that picks it, its fingerprint and number of patches),
and the sha256 of every file under `vllm/` the series changes (its patches
and the overlay), with the files it deletes. The wheel (`make wheel`) and
the container context (`make overlay`) ship the files of the overlay commit
as they are, this one with them, so the same record travels to an editable
tree, a wheel and an image; `vllm._fork` compares each file with it.

The file is generated, never edited: `make refresh` accepts it in the
overlay commit only, and an interrupted build's copy is the tool's own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lib.paths import rel
from lib.proc import git
from lib.series import Series

DIGESTS_FILE = "vllm/_fork_digests.json"
# The installed package: what a wheel or an image carries of the tree.
PACKAGE_DIR = "vllm/"
FORMAT = 1


def changed_package_files(tree: Path, tag: str) -> tuple[list[str], list[str]]:
    """Files under vllm/ the index changes against the upstream `tag`: the
    ones it holds (replaced or added) and the ones it deletes."""
    out = git(
        tree, "diff", "--cached", "--name-status", "--no-renames", "-z", tag, "--"
    )
    fields = out.split("\0")
    held, deleted = [], []
    for status, path in zip(fields[0::2], fields[1::2], strict=False):
        if not path.startswith(PACKAGE_DIR) or path == DIGESTS_FILE:
            continue
        (deleted if status == "D" else held).append(path)
    return sorted(held), sorted(deleted)


def digests_record(tree: Path, series: Series, variable: str) -> dict:
    """The record for the tree's index (the patches committed, the overlay
    files added): every file it holds hashed as written in the tree."""
    base = series.base()
    held, deleted = changed_package_files(tree, base.tag)
    files = {p: hashlib.sha256((tree / p).read_bytes()).hexdigest() for p in held}
    return {
        "format": FORMAT,
        "release": base.version,
        "series": rel(series.dir),
        "make_variable": variable,
        "fingerprint": series.fingerprint(),
        "patches": len(series.patches()),
        "files": files,
        "deleted": deleted,
    }


def write_digests(tree: Path, series: Series, variable: str) -> str:
    """Write and stage the digests file; return its path in the tree.
    `variable` is the make variable that picks the series (VERSION=0.28.0):
    the fix `vllm._fork` prints names it."""
    record = digests_record(tree, series, variable)
    path = tree / DIGESTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # Byte-stable: the same series gives the same file, and the same commit.
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    git(tree, "add", "-f", "--", DIGESTS_FILE)
    return DIGESTS_FILE
