"""Recorded conflict resolutions: how `make rebase` remembers and replays them.

Two kinds, both kept in one store shared by every release's series
(patches/resolutions/), so that a resolution two neighbouring releases
share is stored once:

  rerere/<id>-<digest>/   one conflict as git rerere recorded it, stored as
                          diffs: the conflicted file (rerere's preimage) as
                          a diff from the upstream file it was made on (named
                          by its blob id), and the resolution (the
                          postimage) as a diff from the preimage.
  ports/<key>/            a patch rewritten by hand for a release, whole: its
                          diff from the files before it (rerere replays the
                          conflicted hunks only, not the edits made around
                          them), keyed on the patch and on those files.

A rebase seeds the tree's rr-cache and its port directory from the store
before replaying, and saves what it recorded or replayed back into it.
git rerere keeps whole files (a preimage and a postimage per conflict); the
store keeps diffs and rebuilds the files, with `git diff --no-index` and
`git apply`, from blobs the tree (or the upstream cache) already holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, rel
from lib.proc import git, git_ok, run

STORE = DEFAULT_SERIES / "resolutions"
RERERE = "rerere"
PORTS = "ports"
RERERE_META = "resolution.json"
PREIMAGE_DIFF = "preimage.diff"
POSTIMAGE_DIFF = "postimage.diff"
PORT_META = "port.json"
PORT_DIFF = "port.diff"
TREE_PORTS = "vllm-fork-ports"  # in the tree's git directory
# The line of a series' REBASE.md that names the store entries it used.
USED_LINE = "Recorded resolutions used (patches/resolutions/): "
VARIANT_RE = re.compile(r"^(pre|post)image(?:\.(\d+))?$")
# Beside rerere's images in the tree's rr-cache/<id>/: the file the conflict
# is in. rerere keeps no path, and replays a resolution without naming its
# id; the store needs the path to keep the conflict as a diff.
PATH_NOTE = "vllm-fork-path"


def gitdir(tree: Path) -> Path:
    return Path(git(tree, "rev-parse", "--absolute-git-dir"))


def patch_paths(patch: Path) -> list[str]:
    """The repository paths a patch file changes."""
    return sorted(
        {
            line.split(" b/", 1)[1]
            for line in patch.read_text().splitlines()
            if line.startswith("diff --git ")
        }
    )


def blob_id(tree: Path, rev: str, path: str) -> str:
    """The blob of `path` at `rev`, or "" where it has none."""
    return git(tree, "rev-parse", "-q", "--verify", f"{rev}:{path}", check=False)


# --- diffs between two texts, with git's own machinery ------------------------


def text_diff(before: bytes, after: bytes) -> bytes:
    """A unified diff turning `before` into `after` (b"" if they are equal)."""
    with tempfile.TemporaryDirectory() as tmp:
        for side, data in (("a", before), ("b", after)):
            (Path(tmp) / side).mkdir()
            (Path(tmp) / side / "file").write_bytes(data)
        proc = subprocess.run(
            [
                *("git", "-c", "core.quotepath=false", "diff", "--no-index"),
                *("--no-color", "--no-ext-diff", "--binary", "--full-index"),
                *("--src-prefix=x/", "--dst-prefix=y/", "a/file", "b/file"),
            ],
            cwd=tmp,
            capture_output=True,
            check=False,
        )
    if proc.returncode not in (0, 1):
        raise ForkError(f"git diff --no-index failed: {proc.stderr.decode()}")
    return proc.stdout


def apply_diff(before: bytes, diff: bytes) -> bytes:
    """`before` with a diff made by text_diff applied."""
    if not diff:
        return before
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "file"
        target.write_bytes(before)
        (Path(tmp) / "diff").write_bytes(diff)
        # -p2: "x/a/file" and "y/b/file" both become "file".
        proc = subprocess.run(
            ["git", "apply", "-p2", "--unsafe-paths", "diff"],
            cwd=tmp,
            capture_output=True,
            check=False,
        )
        if proc.returncode != 0:
            raise ForkError(f"a stored diff does not apply: {proc.stderr.decode()}")
        return target.read_bytes()


# --- rerere: one conflict's resolution ---------------------------------------


def rr_cache(tree: Path) -> Path:
    return gitdir(tree) / "rr-cache"


def variants(entry: Path) -> dict[int, tuple[Path, Path]]:
    """rerere's variants of one conflict id: {n: (preimage, postimage)}, for
    those that have both (rerere names them preimage, preimage.1, ...)."""
    found: dict[int, dict[str, Path]] = {}
    for p in entry.iterdir() if entry.is_dir() else []:
        m = VARIANT_RE.match(p.name)
        if m:
            found.setdefault(int(m.group(2) or 0), {})[m.group(1)] = p
    return {
        n: (sides["pre"], sides["post"])
        for n, sides in sorted(found.items())
        if len(sides) == 2
    }


def image_name(kind: str, n: int) -> str:
    return f"{kind}image" + (f".{n}" if n else "")


def note_path(tree: Path, conflict_id: str, path: str) -> None:
    """Remember in the tree which file conflict `conflict_id` is in."""
    entry = rr_cache(tree) / conflict_id
    entry.mkdir(parents=True, exist_ok=True)
    (entry / PATH_NOTE).write_text(path + "\n")


def noted_path(tree: Path, conflict_id: str) -> str:
    note = rr_cache(tree) / conflict_id / PATH_NOTE
    return note.read_text().strip() if note.is_file() else ""


def read_blob(tree: Path, blob: str, cache_repo: Path | None) -> bytes | None:
    """A blob's bytes from the tree, else from the upstream cache; "" is the
    empty file (a file the release does not have)."""
    if not blob:
        return b""
    for repo in (tree, cache_repo):
        if repo is not None and git_ok(repo, "cat-file", "-e", f"{blob}^{{blob}}"):
            return subprocess.run(
                ["git", "-C", str(repo), "cat-file", "blob", blob],
                capture_output=True,
                check=True,
            ).stdout
    return None


def store_images(
    store: Path, meta: dict, base: bytes | None, pre: bytes, post: bytes
) -> str:
    """Keep one recorded conflict in the store; its entry's name. Entries are
    named by their content, so two releases that recorded the same
    resolution on the same upstream file share one."""
    if base is None:  # the blob is in neither the tree nor the cache
        meta = {**meta, "blob": ""}
        base = b""
    pre_diff = text_diff(base, pre)
    post_diff = text_diff(pre, post)
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode() + b"\0" + pre_diff + b"\0" + post_diff)
    name = f"{meta['id']}-{digest.hexdigest()[:12]}"
    dest = store / RERERE / name
    if not dest.is_dir():

        def fill(tmp: Path) -> None:
            tmp.mkdir()
            (tmp / RERERE_META).write_text(text)
            (tmp / PREIMAGE_DIFF).write_bytes(pre_diff)
            (tmp / POSTIMAGE_DIFF).write_bytes(post_diff)

        write_whole(dest, fill)
    return f"{RERERE}/{name}"


def save_conflict(
    tree: Path,
    store: Path,
    conflict_id: str,
    n: int,
    path: str,
    release_ref: str,
    cache_repo: Path | None = None,
) -> str:
    """Store variant `n` of the tree's recorded resolution of `conflict_id`,
    made on `path` of the release `release_ref` ("": the path noted in the
    tree; if none is, the whole preimage is stored)."""
    pre, post = variants(rr_cache(tree) / conflict_id)[n]
    path = path or noted_path(tree, conflict_id)
    blob = blob_id(tree, release_ref, path) if path else ""
    base = read_blob(tree, blob, cache_repo)
    meta = {"id": conflict_id, "path": path, "blob": blob}
    return store_images(store, meta, base, pre.read_bytes(), post.read_bytes())


def seed_conflicts(
    tree: Path, store: Path, mtime: float, cache_repo: Path | None = None
) -> dict[str, str]:
    """Give the tree's rerere every stored resolution whose upstream file it
    (or the cache) holds, as one more variant of its conflict id. A variant
    the tree already has is kept; the copies are dated `mtime` (rerere
    touches the postimage of a resolution it replays, which is how
    `used_conflicts` finds them). Returns {conflict id: path} of what the
    store knows."""
    git(tree, "config", "rerere.enabled", "true")
    git(tree, "config", "rerere.autoupdate", "true")
    paths: dict[str, str] = {}
    root = store / RERERE
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            meta = json.loads((entry / RERERE_META).read_text())
            base = read_blob(tree, meta["blob"], cache_repo)
            if base is None:
                continue  # made on a file this tree never had: it cannot match
            pre = apply_diff(base, (entry / PREIMAGE_DIFF).read_bytes())
            post = apply_diff(pre, (entry / POSTIMAGE_DIFF).read_bytes())
        except (OSError, ValueError, KeyError, ForkError) as e:
            raise ForkError(
                f"the recorded resolution {rel(entry)} is broken ({e}): restore "
                "it from git (git checkout -- " + rel(entry) + "), or delete it "
                "and resolve that conflict again"
            ) from e
        paths[meta["id"]] = meta["path"]
        if meta["path"]:
            note_path(tree, meta["id"], meta["path"])
        dest = rr_cache(tree) / meta["id"]
        have = variants(dest)
        if any(
            a.read_bytes() == pre and b.read_bytes() == post for a, b in have.values()
        ):
            continue
        n = max(have, default=-1) + 1
        dest.mkdir(parents=True, exist_ok=True)
        for kind, data in (("pre", pre), ("post", post)):
            f = dest / image_name(kind, n)
            f.write_bytes(data)
            os.utime(f, (mtime, mtime))
    return paths


def used_conflicts(tree: Path, since: float) -> list[tuple[str, int]]:
    """(conflict id, variant) of the resolutions recorded or replayed since
    `since`."""
    cache = rr_cache(tree)
    if not cache.is_dir():
        return []
    return [
        (entry.name, n)
        for entry in sorted(cache.iterdir())
        for n, (_, post) in variants(entry).items()
        if post.stat().st_mtime >= since
    ]


def merge_rr(tree: Path) -> dict[str, str]:
    """rerere's conflicts in the tree now, {id: path} (from .git/MERGE_RR)."""
    path = gitdir(tree) / "MERGE_RR"
    if not path.exists():
        return {}
    found = {}
    for item in path.read_text().split("\0"):
        if "\t" in item:
            conflict_id, file = item.split("\t", 1)
            found[conflict_id.split(".")[0]] = file
    return found


# --- ports: hand resolutions as diffs -----------------------------------------
# A changed patch or base gets a new key: rerere's hunks, then the user.


def port_key(tree: Path, patch: Path, before: str) -> str:
    digest = hashlib.sha256(patch.read_bytes())
    for path in patch_paths(patch):
        digest.update(f"\0{path}\0{blob_id(tree, before, path) or 'absent'}".encode())
    return digest.hexdigest()[:40]


def release_blobs(tree: Path, release_ref: str, paths: list[str]) -> dict[str, str]:
    return {p: blob_id(tree, release_ref, p) for p in paths}


def seed_ports(tree: Path, store: Path) -> int:
    """Copy the stored ports into the tree (an entry there is kept)."""
    source = store / PORTS
    if not source.is_dir():
        return 0
    seeded = 0
    for entry in sorted(p for p in source.iterdir() if (p / PORT_META).exists()):
        dest = gitdir(tree) / TREE_PORTS / entry.name
        if not dest.exists():
            shutil.copytree(entry, dest)
            seeded += 1
    return seeded


def record_port(
    tree: Path, patch: Path, before: str, release_ref: str, rev: str = ""
) -> str:
    """Record the resolution of `patch` (staged, or committed at `rev`) as
    its diff from `before`, in the tree; its key."""
    key = port_key(tree, patch, before)
    dest = gitdir(tree) / TREE_PORTS / key
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    against = [rev] if rev else ["--cached"]
    changed = git(tree, "diff", "--name-only", before, *against).split()
    paths = sorted(set(patch_paths(patch)) | set(changed))
    diff = subprocess.run(
        ["git", "-C", str(tree), "diff", "--binary", before, *against, "--", *paths],
        capture_output=True,
        check=True,
    ).stdout
    (dest / PORT_DIFF).write_bytes(diff)
    # The release's files: what tells a port of this patch for this release
    # from one for another release (see stale_port).
    meta = {
        "patch": patch.name,
        "paths": paths,
        "release_blobs": release_blobs(tree, release_ref, paths),
    }
    (dest / PORT_META).write_text(json.dumps(meta, indent=1) + "\n")
    return key


def has_port(tree: Path, patch: Path, before: str) -> bool:
    """Whether a port of `patch` is recorded for the files at `before`."""
    key = port_key(tree, patch, before)
    return (gitdir(tree) / TREE_PORTS / key / PORT_META).exists()


def apply_port(tree: Path, patch: Path, before: str) -> str:
    """Stage the recorded port of `patch` on `before`, if there is one;
    return its key ("" if none)."""
    key = port_key(tree, patch, before)
    src = gitdir(tree) / TREE_PORTS / key
    if not (src / PORT_META).exists():
        return ""
    # The port is a diff from `before`: put its files back to that first.
    for path in json.loads((src / PORT_META).read_text())["paths"]:
        if git_ok(tree, "cat-file", "-e", f"{before}:{path}"):
            git(tree, "checkout", before, "--", path)
        else:
            git(tree, "rm", "-q", "-f", "--ignore-unmatch", "--", path)
    if (src / PORT_DIFF).stat().st_size:
        proc = run(
            ["git", "-C", tree, "apply", "--index", str(src / PORT_DIFF)], check=False
        )
        if proc.returncode != 0:
            raise ForkError(
                f"the recorded port {key} of {patch.name} does not apply: "
                f"{proc.stderr.strip()}\nTo resolve the conflict by hand instead, "
                f"delete both copies, {rel(STORE / PORTS / key)}/ (the series "
                f"whose REBASE.md names it must then be rebased again) and "
                f"{rel(src)}/, and rebase again."
            )
    return key


def stale_port(tree: Path, patch: Path, before: str, release_ref: str) -> Path | None:
    """A port of `patch` recorded on the same release's files under another
    key: the patch (or one before it) changed since it was ported by hand,
    and rerere alone would replay the hunks but drop the edits that port
    made around them. Ports of the same patch for other releases are not."""
    ports = gitdir(tree) / TREE_PORTS
    if not ports.is_dir():
        return None
    key = port_key(tree, patch, before)
    for entry in sorted(ports.iterdir()):
        meta_file = entry / PORT_META
        if entry.name == key or not meta_file.exists():
            continue
        meta = json.loads(meta_file.read_text())
        recorded = meta.get("release_blobs", {})
        # The same patch whatever its number in this or that series.
        if same_patch(meta["patch"], patch.name) and recorded == release_blobs(
            tree, release_ref, list(recorded)
        ):
            return entry
    return None


def same_patch(name: str, other: str) -> bool:
    """Whether two patch file names are one patch, numbered by two series
    (0006-X.patch in one series is 0004-X.patch in another)."""
    return name.split("-", 1)[-1] == other.split("-", 1)[-1]


def save_port(tree: Path, key: str, store: Path) -> str:
    """Copy the tree's port `key` into the store, replacing what it held
    under that key (the same patch on the same files: the latest resolution
    is the one meant); its entry's name."""
    src = gitdir(tree) / TREE_PORTS / key
    dest = store / PORTS / key
    write_whole(dest, lambda tmp: shutil.copytree(src, tmp))
    return f"{PORTS}/{key}"


def write_whole(dest: Path, fill) -> None:
    """Write a store entry whole or not at all: `fill` writes a temporary
    directory beside `dest`, which then replaces it (an interrupted write
    leaves no half entry)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-") as tmp:
        staged = Path(tmp) / "entry"
        fill(staged)
        if dest.exists():
            shutil.rmtree(dest)
        staged.rename(dest)


# --- the store as a whole ----------------------------------------------------


def used_by(series_dir: Path) -> list[str]:
    """The store entries a series' REBASE.md says it used."""
    report = series_dir / "REBASE.md"
    if not report.is_file():
        return []
    for line in report.read_text().splitlines():
        if line.startswith(USED_LINE):
            return [e.strip() for e in line[len(USED_LINE) :].split(",") if e.strip()]
    return []


def prune(store: Path, series_dirs: list[Path]) -> list[str]:
    """Remove the store's entries that no series uses any more; their names.
    Nothing is removed while a series' REBASE.md reports recorded
    resolutions but names none (a line lost by hand or in a merge): what
    it uses cannot be told."""
    for d in series_dirs:
        report = d / "REBASE.md"
        if report.is_file() and "(recorded)" in report.read_text() and not used_by(d):
            return []
    used = {e for d in series_dirs for e in used_by(d)}
    removed = []
    for kind in (RERERE, PORTS):
        root = store / kind
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            name = f"{kind}/{entry.name}"
            if name not in used:
                shutil.rmtree(entry)
                removed.append(name)
    return removed


def check_store(store: Path, series_dirs: list[Path]) -> list[str]:
    """Problems: entries a series names that the store lacks."""
    return [
        f"{rel(d / 'REBASE.md')} names {e}, which {rel(store)}/ lacks"
        for d in series_dirs
        for e in used_by(d)
        if not (store / e).is_dir()
    ]
