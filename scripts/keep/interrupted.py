"""A build of the tree cut short, and how the next run takes it back.

Before `make apply` moves a tree (the fetch, the checkout of the base, each
`git am`, the overlay commit) it writes `vllm-fork-apply.json` into the
tree's git directory: the release and series it is building and where HEAD
was. The file goes once the tree is built, or when a patch stops on a
conflict and the tree is handed to the user. So a marker found by the next
run means the last one was interrupted (Ctrl-C, a kill, a timeout) and the
tree may hold a half-done checkout or `git am` of the tool's own making.

That leftover state must not be mistaken for the user's work (today's
"uncommitted changes: commit them" would put it into the series), nor
thrown away blindly (the user may have edited since). `take_back` checks
every changed path against what the tool could have written there: the
file as one of the commits involved has it (the old HEAD, the base, the
patch commits made so far), as a patch of the series leaves it (the blob
ids of `--full-index` patches) or as the overlay has it (the build
digests the overlay step writes, vllm/_fork_digests.json, are the tool's
own whatever they hold: keep/build_digests.py). Only when every
change is accounted for is the tree reset; anything else is refused, named,
and left in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from keep.build_digests import DIGESTS_FILE
from lib.errors import ForkError
from lib.paths import rel
from lib.proc import git, git_ok, run
from lib.series import Series

MARKER = "vllm-fork-apply.json"
# Stands for "no file at this path" among the contents a path may have.
ABSENT = "0" * 40
INDEX_LINE = re.compile(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})")
DIFF_LINE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def gitdir(tree: Path) -> Path:
    return Path(git(tree, "rev-parse", "--absolute-git-dir"))


def read_marker(tree: Path) -> dict | None:
    """The interrupted build's record, or None if the last build finished."""
    if not (tree / ".git").exists():
        return None
    path = gitdir(tree) / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        # Half-written by a kill during the write itself: still ours.
        return {"release": "?", "series": "?", "stage": "?"}
    return data if isinstance(data, dict) else {"release": "?", "stage": "?"}


def record(tree: Path, **fields: str | None) -> None:
    """Write (or update) the marker; written whole, so a kill leaves the old
    marker or the new one, never a torn file."""
    path = gitdir(tree) / MARKER
    data = {**(read_marker(tree) or {}), **fields}
    tmp = path.with_name(MARKER + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def clear(tree: Path) -> None:
    (gitdir(tree) / MARKER).unlink(missing_ok=True)


def blob_id(data: bytes) -> str:
    """git's id of a blob with these bytes (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def worktree_blob(tree: Path, path: str) -> str:
    file = tree / path
    if file.is_symlink():
        return blob_id(os.readlink(file).encode())
    if not file.exists():
        return ABSENT
    if file.is_dir():  # a submodule or a directory where a file was
        return "dir"
    return blob_id(file.read_bytes())


def tree_contents(tree: Path, commit: str) -> dict[str, str]:
    """Every file of `commit`, with its blob id."""
    files = {}
    for entry in git(tree, "ls-tree", "-r", "-z", "--full-tree", commit).split("\0"):
        if entry:
            meta, path = entry.split("\t", 1)
            files[path] = meta.split()[2]
    return files


def contents_from_series(series: Series) -> dict[str, set[str]]:
    """What the series' patches and overlay leave at each path they touch."""
    allowed: dict[str, set[str]] = {}
    for patch in series.patches():
        old = new = None
        for line in patch.path.read_text(errors="replace").splitlines():
            if m := DIFF_LINE.match(line):
                old, new = m.group(1), m.group(2)
            elif (m := INDEX_LINE.match(line)) and old and new:
                allowed.setdefault(old, set()).add(m.group(1))
                allowed.setdefault(new, set()).add(m.group(2))
    for f in series.overlay_files():
        data = (series.overlay / f).read_bytes()
        allowed.setdefault(str(f), set()).add(blob_id(data))
    return allowed


def changed_paths(tree: Path) -> tuple[dict[str, str], list[str]]:
    """Paths whose index or working file differs from HEAD, each with the
    blob the index holds for it (ABSENT if none); and the untracked files."""
    has_head = git_ok(tree, "rev-parse", "-q", "--verify", "HEAD")
    against = "HEAD" if has_head else git(tree, "hash-object", "-t", "tree", os.devnull)
    staged = git(tree, "diff", "--cached", "--name-only", "-z", against).split("\0")
    unstaged = git(tree, "diff", "--name-only", "-z").split("\0")
    paths = {p for p in staged + unstaged if p}
    index: dict[str, str] = {}
    if paths:
        out = git(tree, "ls-files", "-s", "-z", "--", *sorted(paths))
        for entry in out.split("\0"):
            if entry:
                meta, path = entry.split("\t", 1)
                index[path] = meta.split()[1]
    untracked = git(tree, "ls-files", "-z", "--others", "--exclude-standard").split(
        "\0"
    )
    return {p: index.get(p, ABSENT) for p in paths}, [p for p in untracked if p]


def unexplained(
    tree: Path, allowed: dict[str, set[str]], commits: list[dict[str, str]]
) -> tuple[list[str], list[str]]:
    """The changed paths the tool cannot have written, and the untracked
    files it did write (to be removed). `allowed` is what the series leaves
    at each path; `commits` the files of each commit involved."""
    tracked, untracked = changed_paths(tree)
    strange, ours = [], []
    for path in sorted(tracked) + sorted(untracked):
        if path == DIGESTS_FILE:  # generated by the overlay step, never edited
            if path not in tracked:
                ours.append(path)
            continue
        ok = set(allowed.get(path, ()))
        for files in commits:
            ok.add(files.get(path, ABSENT))
        staged = tracked.get(path)
        if (staged is not None and staged not in ok) or worktree_blob(
            tree, path
        ) not in ok:
            strange.append(path)
        elif staged is None:
            ours.append(path)
    return strange, ours


def clear_stale_locks(tree: Path) -> None:
    """Lock files git leaves when it is killed outright (SIGKILL), which
    would make every later git command in the tree fail. Only called with the
    marker present: the tool was running in this tree and is not now."""
    gd = gitdir(tree)
    for lock in [gd / "index.lock", gd / "HEAD.lock", *gd.glob("refs/**/*.lock")]:
        lock.unlink(missing_ok=True)


def take_back(
    tree: Path, series: list[Series], marker: dict, overlay: Path, hint: str
) -> None:
    """Undo an interrupted build's half-done work in `tree`, or refuse.

    `series` are the series whose files may be there (the one the marker
    names and the one asked for now), `overlay` the overlay directory. On
    success the tree is clean at its HEAD (the old build when the checkout
    was cut short, a partial series when `git am` was) and the marker is
    gone: the caller builds as usual. `hint` is the command that finishes
    the job, for the refusal."""
    clear_stale_locks(tree)

    def exists(rev: str | None) -> bool:
        return bool(rev) and git_ok(tree, "rev-parse", "-q", "--verify", rev)

    target = marker.get("target")
    commits = [c for c in (marker.get("old_head"), "HEAD", target) if exists(c)]
    if exists(target) and exists("HEAD"):
        # The patch commits the cut-short `git am` made on the base.
        commits += git(tree, "rev-list", "-n100", f"{target}..HEAD").split()
    files = [tree_contents(tree, c) for c in commits]
    allowed: dict[str, set[str]] = {}
    for s in series:
        for path, blobs in contents_from_series(Series(s.dir, overlay)).items():
            allowed.setdefault(path, set()).update(blobs)
    strange, ours = unexplained(tree, allowed, files)
    if strange:
        shown = "\n".join(f"  {p}" for p in strange[:10])
        more = f"\n  ... and {len(strange) - 10} more" if len(strange) > 10 else ""
        raise ForkError(
            f"{rel(tree)}/ holds an interrupted `make apply` (building "
            f"{marker.get('release', '?')}) and changes it did not make:\n"
            f"{shown}{more}\nNothing was changed. Put them aside (git -C "
            f"{rel(tree)} stash -u), then run `{hint}`: it finishes the build."
        )
    gd = gitdir(tree)
    if (gd / "rebase-apply").exists():
        # The tool's own `git am`, cut short: drop its state, keep HEAD.
        run(["git", "-C", tree, "am", "--quit"], check=False)
    if git_ok(tree, "rev-parse", "-q", "--verify", "HEAD"):
        git(tree, "reset", "-q", "--hard", "HEAD")
    else:  # cut short in the first checkout of a new tree: no commit yet
        git(tree, "read-tree", "--empty")
    for path in ours:
        (tree / path).unlink(missing_ok=True)
        parent = (tree / path).parent
        while parent != tree and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    clear(tree)
