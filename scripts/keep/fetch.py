#!/usr/bin/env python3
"""Fetch a series' pinned upstream base and import it as a git commit.

The release's sdist is downloaded once into the cache (.cache/sdist/),
checked against the sha256 pinned in the series' base.toml, and imported
into the cache repository (.cache/upstream.git) as a root commit tagged
upstream/v<version>. The import is deterministic (fixed identity, the
sdist's own timestamp), so every machine gets the same commit id; `apply`
and `rebase` fetch the tag from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import CACHE, rel
from lib.proc import git, git_ok, run, tool_identity_env
from lib.series import Base, add_series_arguments, series_from_arguments

PYPI_SIMPLE = "https://pypi.org/simple/vllm/"
# Build outputs that sdists carry; the tree regenerates them on install.
SDIST_BUILD_OUTPUTS = ("PKG-INFO", "vllm.egg-info", "vllm/_version.py")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, dest: Path) -> None:
    """Download `url` to `dest`, printing progress for large files."""
    say(f"    downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(dest, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done, shown = 0, -10
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if total and (pct := 100 * done // total) >= shown + 10:
                    shown = pct
                    say(f"    {pct:3d}%  {done / 1e6:.1f} / {total / 1e6:.1f} MB")
    except OSError as e:
        raise ForkError(f"cannot download {url}: {e}") from e


def sdist_path(base: Base, cache: Path = CACHE) -> Path:
    return cache / "sdist" / base.sdist_url.rsplit("/", 1)[-1]


def ensure_sdist(base: Base, base_file: Path, cache: Path = CACHE) -> Path:
    """Return the cached sdist of `base`, downloading it if needed, verified."""
    path = sdist_path(base, cache)
    if path.exists():
        got = sha256_file(path)
        if got != base.sdist_sha256:
            raise ForkError(
                f"checksum mismatch for the cached {rel(path)}:\n"
                f"  expected {base.sdist_sha256} (pinned in {rel(base_file)})\n"
                f"  got      {got}\n"
                f"Delete {rel(path)} to download it again, or fix the pin."
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    download(base.sdist_url, part)
    got = sha256_file(part)
    if got != base.sdist_sha256:
        part.unlink()
        raise ForkError(
            f"checksum mismatch for {base.sdist_url}:\n"
            f"  expected {base.sdist_sha256} (pinned in {rel(base_file)})\n"
            f"  got      {got}\n"
            "The download was discarded. If upstream really changed the file, "
            "update sdist_sha256 after checking why."
        )
    part.rename(path)
    return path


@contextlib.contextmanager
def import_lock(cache: Path) -> Iterator[None]:
    """Hold the cache's import lock for a download and import.

    Two processes that need the same release at once (pytest-xdist
    workers on a fresh cache, a make target beside a test run) would both
    download into one .part file and both write its tag; the second tag
    write fails. fcntl's lock (the standard library's; the filelock package
    would need a venv that fetch, run by the system python, cannot count
    on) ends with the process, so an interrupt leaves nothing to clean.
    """
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "import.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"    waiting for another process's import ({rel(cache)}/import.lock)")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def upstream_repo(cache: Path = CACHE) -> Path:
    """The bare repository that holds every imported upstream release."""
    repo = cache / "upstream.git"
    if not (repo / "HEAD").exists():
        repo.mkdir(parents=True, exist_ok=True)
        run(["git", "init", "-q", "--bare", repo])
    return repo


def _import_tree(repo: Path, src: Path, message: str, date: str) -> str:
    """Commit the files under `src` as a root commit in bare `repo`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**tool_identity_env(date), "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        gitw = ["git", f"--git-dir={repo}", f"--work-tree={src}"]
        # -f: the sdist is the source of truth, even where upstream's own
        # .gitignore would skip a file it ships.
        run([*gitw, "add", "-A", "-f", "."], env=env)
        tree = run([*gitw, "write-tree"], env=env).stdout.strip()
        return run([*gitw, "commit-tree", tree, "-m", message], env=env).stdout.strip()


def import_sdist(base: Base, sdist: Path, repo: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tar:
            members = tar.getmembers()
            top = members[0].name.split("/")[0]
            date = f"{int(max(m.mtime for m in members))} +0000"
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / top
        for name in SDIST_BUILD_OUTPUTS:
            p = src / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        message = (
            f"Import upstream vLLM {base.version}\n\n"
            f"From {sdist.name}, sha256 {base.sdist_sha256}\n"
        )
        return _import_tree(repo, src, message, date)


def fetch_git_commit(url: str, ref: str, repo: Path) -> str:
    """Fetch `ref` of the git repository at `url` into `repo`; its commit id."""
    say(f"    fetching {url} {ref}")
    run(["git", "-C", repo, "fetch", "-q", "--depth", "1", url, ref])
    return git(repo, "rev-parse", "FETCH_HEAD^{commit}")


def import_git(base: Base, repo: Path) -> str:
    """Alternative source: upstream's own repository at base.git_ref.

    Imported like an sdist, as a root commit with the tool's identity (the
    fetched commit's tree and date), so trees never depend on a shallow
    history and the same ref gives the same commit id everywhere."""
    commit = fetch_git_commit(base.git_url, base.git_ref, repo)
    if base.git_commit and commit != base.git_commit:
        raise ForkError(
            f"{base.git_url} {base.git_ref} is now {commit}, not the pinned "
            f"git_commit {base.git_commit}. Pin the new commit if that is intended."
        )
    date = git(repo, "log", "-1", "--format=%ct +0000", commit)
    message = (
        f"Import upstream vLLM {base.version}\n\n"
        f"From {base.git_url} {base.git_ref}, commit {commit}\n"
    )
    return git(
        repo,
        "commit-tree",
        f"{commit}^{{tree}}",
        "-m",
        message,
        env=tool_identity_env(date),
    )


def ensure_base(
    base: Base, base_file: Path, cache: Path = CACHE, source: str | None = None
) -> Path:
    """Make sure upstream/v<version> exists in the cache repo; return the repo.

    `source` defaults to where the base is pinned: its sdist, or its git
    commit for a base made from a git ref."""
    source = source or base.source
    if source == "sdist" and not base.sdist_url:
        raise ForkError(f"{rel(base_file)} pins a git commit, not an sdist")
    with import_lock(cache):
        return _ensure_base_locked(base, base_file, cache, source)


def _ensure_base_locked(base: Base, base_file: Path, cache: Path, source: str) -> Path:
    repo = upstream_repo(cache)
    if git_ok(repo, "rev-parse", "-q", "--verify", f"refs/tags/{base.tag}"):
        message = git(repo, "log", "-1", "--format=%B", base.tag)
        expected = base.sdist_sha256 if source == "sdist" else base.git_commit
        if expected and expected not in message:
            raise ForkError(
                f"{rel(repo)} holds {base.tag} imported from another source than "
                f"the one pinned in {rel(base_file)} ({expected[:12]}...).\n"
                f"Delete the tag (git -C {rel(repo)} tag -d {base.tag}) to re-import."
            )
        return repo
    step(f"importing upstream vLLM {base.version} ({source})")
    if source == "git":
        commit = import_git(base, repo)
    else:
        commit = import_sdist(base, ensure_sdist(base, base_file, cache), repo)
    git(repo, "tag", base.tag, commit)
    say(f"    {base.tag} = {commit[:12]}")
    return repo


def resolve_git(url: str, ref: str, version: str, cache: Path = CACHE) -> Base:
    """A base made from a git ref: the commit it names now becomes the pin."""
    commit = fetch_git_commit(url, ref, upstream_repo(cache))
    return Base(version=version, git_url=url, git_ref=ref, git_commit=commit)


def resolve_release(version: str) -> Base:
    """Look a release's sdist up on PyPI (URL and sha256 from the index)."""
    req = urllib.request.Request(
        PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            files = json.load(resp)["files"]
    except OSError as e:
        raise ForkError(f"cannot reach the PyPI index {PYPI_SIMPLE}: {e}") from e
    name = f"vllm-{version}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return Base(
                version=version,
                sdist_url=f["url"],
                sdist_sha256=f["hashes"]["sha256"],
                git_ref=f"v{version}",
            )
    raise ForkError(f"PyPI has no sdist {name}: is {version} a vLLM release?")


def main() -> int:
    p = parser(__doc__)
    add_series_arguments(p)
    p.add_argument(
        "--source",
        choices=("sdist", "git"),
        help="import the sdist from PyPI or upstream's git (default: what "
        "base.toml pins)",
    )
    p.add_argument(
        "--print-base",
        metavar="VERSION",
        help="print a base.toml for a release, looked up on PyPI",
    )
    args = p.parse_args()
    if args.print_base:
        sys.stdout.write(resolve_release(args.print_base).to_toml())
        return 0
    series = series_from_arguments(args)
    base = series.base()
    repo = ensure_base(base, series.base_file, source=args.source)
    say(
        f"upstream vLLM {base.version}: {git(repo, 'rev-parse', base.tag)} "
        f"in {rel(repo)}"
    )
    return 0


if __name__ == "__main__":
    main_guard(main)
