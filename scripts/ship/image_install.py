#!/usr/bin/env python3
"""Lay vllm-fork's files over the vLLM installed in this environment.

Runs inside upstream's container image (see Dockerfile, written by `make
overlay`), with only the standard library. Reads manifest.json next to this
file, then:
  1. checks every file it will touch is exactly the upstream release's
     (or already the fork's): a different vLLM is refused, nothing changed;
  2. writes the fork's files, drops deleted ones, removes their stale
     bytecode and compiles them again;
  3. updates the distribution's RECORD so pip still knows every file.
Running it twice changes nothing the second time.
"""

from __future__ import annotations

import argparse
import base64
import compileall
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import sys
from pathlib import Path

MANIFEST = "manifest.json"


class InstallError(Exception):
    pass


def sha256_of(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def site_dir() -> Path:
    """The directory holding the installed `vllm` package."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise InstallError(f"no vllm package is installed for {sys.executable}")
    return Path(list(spec.submodule_search_locations)[0]).parent


def check(manifest: dict, site: Path) -> list[dict]:
    """The files still to change; raise if any is neither upstream's nor ours."""
    installed = importlib.metadata.version("vllm")
    if installed.split("+")[0] != manifest["version"]:
        raise InstallError(
            f"this image has vllm {installed}, the overlay is for "
            f"{manifest['version']}: build FROM upstream's image of that release"
        )
    todo, wrong = [], []
    for f in manifest["files"]:
        have = sha256_of(site / f["path"])
        if have == f["sha256"]:
            continue
        if have != f["upstream_sha256"]:
            wrong.append(f"{site / f['path']} ({f['action']}; sha256 {have})")
        todo.append(f)
    if wrong:
        raise InstallError(
            f"these files are not vLLM {manifest['version']}'s own, nothing was "
            "changed:\n  " + "\n  ".join(wrong)
        )
    return todo


def drop_bytecode(path: Path) -> None:
    """Stale .pyc files could be used instead of the new source."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()


def record_row(path: Path, root: Path) -> list[str]:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [
        path.relative_to(root).as_posix(),
        f"sha256={digest.decode()}",
        str(len(data)),
    ]


def bytecode_of(site: Path, path: str) -> list[str]:
    """The compiled files of `path` that exist, relative to `site`."""
    src = site / path
    found = (src.parent / "__pycache__").glob(f"{src.stem}.*.pyc")
    return sorted(p.relative_to(site).as_posix() for p in found)


def source_of(path: str) -> str:
    """The source a RECORD path belongs to: itself, or a .pyc's .py file."""
    p = Path(path)
    if p.parent.name == "__pycache__" and p.suffix == ".pyc":
        return (p.parent.parent / (p.name.split(".")[0] + ".py")).as_posix()
    return path


def update_record(site: Path, paths: list[str]) -> Path | None:
    """Rewrite the RECORD rows of the changed paths (relative to `site`).

    Files get their new sha256 and size; their bytecode gets rows without a
    hash, as pip writes them, so that `pip uninstall` removes all of it.
    """
    dist = importlib.metadata.distribution("vllm")
    record = next(
        (
            Path(str(dist.locate_file(f)))
            for f in dist.files or []
            if f.name == "RECORD"
        ),
        None,
    )
    if record is None or not record.is_file():
        return None
    rows = [r for r in csv.reader(io.StringIO(record.read_text())) if r]
    rows = [r for r in rows if source_of(r[0]) not in paths]
    for p in sorted(paths):
        if (site / p).is_file():
            rows.append(record_row(site / p, site))
            rows += [[pyc, "", ""] for pyc in bytecode_of(site, p)]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    record.write_text(buf.getvalue())
    return record


def install(payload: Path) -> str:
    manifest = json.loads((payload / MANIFEST).read_text())
    site = site_dir()
    todo = check(manifest, site)
    for f in todo:
        dest = site / f["path"]
        drop_bytecode(dest)
        if f["action"] == "delete":
            dest.unlink(missing_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((payload / "files" / f["path"]).read_bytes())
        if sha256_of(dest) != f["sha256"]:
            raise InstallError(f"{dest} does not have the content the manifest says")
        if dest.suffix == ".py":
            compileall.compile_file(str(dest), quiet=1)
    update_record(site, [f["path"] for f in todo])
    return (
        f"{manifest['fork']} {manifest['fork_version']}: {len(todo)} of "
        f"{len(manifest['files'])} files changed in {site}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "payload",
        type=Path,
        nargs="?",
        default=Path(__file__).resolve().parent,
        help="directory with manifest.json and files/ (default: this file's)",
    )
    args = p.parse_args()
    try:
        print(install(args.payload))
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
