#!/usr/bin/env python3
"""Cut upstream vLLM's history down to what the series and its reproducers need.

    make upstream-cut                                   # the stand-in (make standin)
    make upstream-cut UPSTREAM=~/src/vllm               # a clone of vLLM
    make upstream-cut UPSTREAM=https://github.com/vllm-project/vllm.git

Walking upstream's history commit by commit (make bisect-upstream) means
checking out tens of thousands of files per step. The cut keeps only:

- the files the reproducers import, found by running them: each release tag
  of the history that the project carries a series for is checked out, its
  reproducers are run with its own test environment, and every module they
  loaded from the tree is kept (--closure-at picks other tags);
- the files the patches of every series change (vllm/v1/core,
  vllm/v1/simple_kv_offload, the tests they add);
- requirements/ and pyproject.toml (the test environment is chosen from
  them), and whatever --keep names.

`git filter-repo` (installed into .venv from PyPI on first use) rewrites a
bare copy of the source into .work/upstream/cut.git; the source is never
touched. Commits that change none of these paths disappear, so a bisection
steps only over commits that can matter. A commit between two releases that
imports a file no release imported is not in the cut: the bisection skips
that commit (and says so); --keep the file to step over it.

Prints and writes (.work/upstream/cut.json) the size and the number of
commits before and after, and the time each part took.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.standin import STANDIN, upstream_or_standin
from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import git, run
from lib.series import Series, find_series, version_key
from lib.testenv import pytest_cmd, tree_env
from lib.venv import VENV, pip_install, release_venv

CUT = WORK / "upstream" / "cut.git"
FILTER_REPO = "git-filter-repo==2.47.0"
# Always kept: where the test environment comes from.
ALWAYS = ["requirements/", "pyproject.toml", "setup.py"]
# Installed as sitecustomize in every Python process the reproducers start
# (vLLM inspects models in a subprocess): at exit, each lists the files of
# the tree it imported into $FORK_CLOSURE_DIR/<pid>.json.
PROBE = """\
import atexit, json, os, sys

def _fork_closure_dump():
    tree = os.environ["FORK_CLOSURE_TREE"]
    files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
    out = os.path.join(os.environ["FORK_CLOSURE_DIR"], f"{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump(sorted(x for x in files if x and x.startswith(tree)), f)

atexit.register(_fork_closure_dump)
"""


def filter_repo() -> Path:
    """git-filter-repo, installed into .venv on first use."""
    tool = VENV / "bin" / "git-filter-repo"
    if not tool.exists():
        step(f"installing {FILTER_REPO} into {rel(VENV)}")
        pip_install(VENV, ["-q", FILTER_REPO])
    return tool


def history_stats(repo: Path) -> dict:
    """Commits reachable from any ref, and the repository's size on disk."""
    git(repo, "gc", "-q", "--prune=now")
    objects = dict(
        line.split(": ", 1) for line in git(repo, "count-objects", "-v").splitlines()
    )
    size_kib = int(objects["size-pack"]) + int(objects["size"])
    return {
        "commits": int(git(repo, "rev-list", "--all", "--count")),
        "size_mib": round(size_kib / 1024, 1),
    }


def patched_paths(series_list: list[Series]) -> set[str]:
    """Every file a patch of any series changes."""
    paths = set()
    for s in series_list:
        for p in s.patches():
            paths.update(re.findall(r"(?m)^diff --git a/(\S+) b/", p.path.read_text()))
    return paths


def reproducer_files(series_list: list[Series]) -> list[str]:
    return sorted(
        {
            t.split("::")[0]
            for s in series_list
            for p in s.patches()
            for t in p.reproducers()
        }
    )


def closure_tags(repo: Path, series_list: list[Series]) -> list[str]:
    """The release tags of the history that the project carries a series for."""
    have = set(git(repo, "tag", "--list", "v*").split())
    wanted = {f"v{s.base().version}" for s in series_list}
    return sorted(have & wanted, key=version_key)


def imported_files(
    repo: Path,
    tag: str,
    tests: list[str],
    repro_root: Path = ROOT,
    python: Path | None = None,
) -> set[str]:
    """The files of `tag`'s tree that its reproducers import, found by
    running them there (they may fail: the bug is there; they still import
    what the fixed code would)."""
    with tempfile.TemporaryDirectory(prefix="vllm-fork-closure-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        archive = Path(tmp) / "tree.tar"
        run(["git", "-C", repo, "archive", "-o", archive, tag])
        run(["tar", "-xf", archive, "-C", tree])
        py = python or release_venv(
            tag.removeprefix("v"), tree / "requirements" / "common.txt"
        )
        probe, found = Path(tmp) / "probe", Path(tmp) / "found"
        probe.mkdir()
        found.mkdir()
        (probe / "sitecustomize.py").write_text(PROBE)
        env = tree_env(tree)
        env["PYTHONPATH"] = os.pathsep.join([str(probe), env["PYTHONPATH"]])
        env["FORK_CLOSURE_TREE"] = str(tree) + "/"
        env["FORK_CLOSURE_DIR"] = str(found)
        args = ["--continue-on-collection-errors", *tests]
        run(
            pytest_cmd(py, Path(tmp) / "junit.xml", *args),
            cwd=repro_root,
            env=env,
            check=False,
        )
        dumps = list(found.glob("*.json"))
        if not dumps:
            raise ForkError(f"the reproducers did not run on {tag} (python {py})")
        prefix = len(str(tree)) + 1
        return {f[prefix:] for d in dumps for f in json.loads(d.read_text())}


def cut_paths(
    repo: Path,
    series_list: list[Series],
    tags: list[str],
    keep: list[str],
    repro_root: Path = ROOT,
    python: Path | None = None,
) -> list[str]:
    tests = reproducer_files(series_list)
    paths = set(ALWAYS) | set(keep) | patched_paths(series_list)
    for i, tag in enumerate(tags, 1):
        found = imported_files(repo, tag, tests, repro_root, python)
        say(f"    [{i}/{len(tags)}] {tag}: the reproducers import {len(found)} files")
        paths |= found
    return sorted(paths)


def make_cut(
    source: str,
    out: Path = CUT,
    series_list: list[Series] | None = None,
    tags: list[str] | None = None,
    keep: list[str] | None = None,
    repro_root: Path = ROOT,
    python: Path | None = None,
) -> dict:
    series_list = series_list if series_list is not None else find_series()
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run(["git", "clone", "-q", "--bare", "--no-local", source, out])
    before = history_stats(out)
    seconds["clone"] = time.monotonic() - t0
    t0 = time.monotonic()
    tags = tags if tags is not None else closure_tags(out, series_list)
    if not tags:
        raise ForkError(
            f"{source} has no tag v<release> for a release the project carries "
            "a series for: name the tags to run the reproducers at (--closure-at)"
        )
    paths = cut_paths(out, series_list, tags, keep or [], repro_root, python)
    seconds["closure"] = time.monotonic() - t0
    t0 = time.monotonic()
    listing = out / "fork-cut-paths.txt"
    listing.write_text("".join(f"{p}\n" for p in paths))
    run([filter_repo(), "--force", "--quiet", "--paths-from-file", listing], cwd=out)
    after = history_stats(out)
    seconds["filter"] = time.monotonic() - t0
    result = {
        "source": source,
        "closure_at": tags,
        "paths": paths,
        "before": before,
        "after": after,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    (out.parent / "cut.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--upstream",
        help="path or URL of a vLLM clone (default: the stand-in history, "
        f"{rel(STANDIN)}, made by make standin when missing)",
    )
    p.add_argument(
        "--closure-at",
        action="append",
        metavar="TAG",
        help="run the reproducers at these tags to find the files they import "
        "(default: every v<release> tag the project carries a series for)",
    )
    p.add_argument(
        "--keep",
        action="append",
        metavar="PATH",
        help="keep this path as well (repeatable)",
    )
    p.add_argument("--out", type=Path, default=CUT, help=f"default: {rel(CUT)}")
    args = p.parse_args()
    source = upstream_or_standin(args.upstream)
    step(f"cutting {source} into {rel(args.out)}")
    r = make_cut(source, args.out.resolve(), tags=args.closure_at, keep=args.keep)
    b, a = r["before"], r["after"]
    say(
        f"    kept {len(r['paths'])} paths "
        f"(listed in {rel(args.out)}/fork-cut-paths.txt)"
    )
    print("| | commits | size (MiB) |\n| --- | --- | --- |")
    print(f"| {r['source']} | {b['commits']} | {b['size_mib']} |")
    print(f"| cut | {a['commits']} | {a['size_mib']} |")
    s = r["seconds"]
    print(
        f"\nclone {s['clone']:.0f} s, closure {s['closure']:.0f} s, "
        f"filter {s['filter']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    main_guard(main)
