"""Where the fork's files are: the repository, the default series and tree,
the cache, the work and output directories; paths as the user types them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lib.errors import ForkError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SERIES = ROOT / "patches"
DEFAULT_TREE = ROOT / "vllm"
OVERLAY = ROOT / "overlay"
CACHE = Path(os.environ.get("VLLM_FORK_CACHE", ROOT / ".cache"))
WORK = ROOT / ".work"
DIST = ROOT / "dist"
# Marks a directory a tool writes whole (a build context, an export), so a
# later run may empty it while refusing to empty anything else.
OUTPUT_MARKER = ".vllm-fork-output"


def rel(path: Path) -> str:
    """A path as the user would type it from the repository root."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def fresh_output_dir(path: Path, what: str) -> Path:
    """Empty `path` for a tool to write `what` into; never delete user files.

    A directory that exists, is not empty and lacks the marker a previous
    run left is refused: it is not ours to delete.
    """
    if path.exists():
        if not path.is_dir():
            raise ForkError(f"{rel(path)} is a file: pass another output directory")
        if any(path.iterdir()) and not (path / OUTPUT_MARKER).exists():
            raise ForkError(
                f"{rel(path)}/ exists and was not written by vllm-fork, so it was "
                "left alone. Pass another output directory, or remove it yourself."
            )
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / OUTPUT_MARKER).write_text(
        f"{what}, written by vllm-fork: the next run replaces this directory.\n"
    )
    return path
