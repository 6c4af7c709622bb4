"""What the series changes in the installed `vllm` package.

The patched wheel and the container overlay ship the same thing: the files
under vllm/ that differ between the upstream base and a tree built from the
series (its patches and the overlay). Everything else the series touches
(tests, docs) stays out of the package. Kernel sources are refused: they
only reach users through a CUDA build, which is what shipping avoids.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from keep.apply import apply_series, check_clean, head_fingerprint, make_hint
from lib.errors import ForkError
from lib.paths import WORK, rel
from lib.proc import git, git_bytes
from lib.series import Series

PACKAGE_DIR = "vllm/"
# Compiled into vLLM's extension modules; the .so files stay upstream's.
KERNEL_SOURCES = ("csrc/", "cmake/", "CMakeLists.txt")


@dataclass
class PackageChanges:
    """Paths (relative to the tree, e.g. vllm/v1/core/block_pool.py)."""

    version: str
    tag: str
    replaced: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    not_shipped: list[str] = field(default_factory=list)

    @property
    def shipped(self) -> list[str]:
        """Files whose patched content goes into the package."""
        return sorted(self.replaced + self.added)

    def summary(self) -> str:
        return (
            f"{len(self.replaced)} replaced, {len(self.added)} added, "
            f"{len(self.deleted)} deleted"
        )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def add_ship_tree_argument(p: argparse.ArgumentParser) -> None:
    """--tree, as ship_tree reads it (make wheel, overlay and image)."""
    p.add_argument(
        "--tree",
        type=Path,
        help="patched tree to take the files from; must be built from the series "
        "(default: build .work/v<version>/series)",
    )


def ship_tree(series: Series, tree: Path | None = None) -> Path:
    """The patched tree to ship from.

    Without `tree`, .work/v<version>/series is built from the series (the
    tree `make test` checks). A given tree must be clean and built from
    exactly this series, so that what ships is what the series says.
    """
    if tree is None:
        tree = WORK / f"v{series.base().version}" / "series"
        apply_series(series, tree)
        return tree
    if not (tree / ".git").exists():
        raise ForkError(f"{rel(tree)}/ is not a tree built by `make apply`")
    check_clean(tree, series)
    have, want = head_fingerprint(tree), series.fingerprint()
    if have != want:
        raise ForkError(
            f"{rel(tree)}/ is not built from {rel(series.dir)}/ (its HEAD records "
            f"series {have or 'none'}, the series is {want}). Run "
            f"`{make_hint('apply', tree, series)}`, or leave out --tree to build "
            "a tree from the series."
        )
    return tree


def package_changes(tree: Path, series: Series) -> PackageChanges:
    """Compare the tree's HEAD with its upstream base, file by file."""
    base = series.base()
    changes = PackageChanges(base.version, base.tag)
    out = git(tree, "diff", "--name-status", "--no-renames", "-z", base.tag, "HEAD")
    fields = out.split("\0")
    pairs = zip(fields[0::2], fields[1::2], strict=False)
    for status, path in pairs:
        if not path:
            continue
        if path.startswith(KERNEL_SOURCES):
            who = git(tree, "log", "--format=%s", f"{base.tag}..HEAD", "--", path)
            raise ForkError(
                f"the series changes {path} ({who.splitlines()[0] if who else '?'})"
                ", which is compiled into vLLM's kernels. A wheel or image made "
                "from upstream's binaries cannot carry it: build vLLM from source "
                "(make install on a GPU machine) instead."
            )
        if not path.startswith(PACKAGE_DIR):
            changes.not_shipped.append(path)
        elif status == "D":
            changes.deleted.append(path)
        elif status == "A":
            changes.added.append(path)
        else:
            changes.replaced.append(path)
    return changes


def base_content(tree: Path, changes: PackageChanges, path: str) -> bytes:
    """The file as upstream's release has it."""
    return git_bytes(tree, "show", f"{changes.tag}:{path}")


def patched_content(tree: Path, path: str) -> bytes:
    """The file as the series has it (from HEAD, not the working files)."""
    return git_bytes(tree, "show", f"HEAD:{path}")
