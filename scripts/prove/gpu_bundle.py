"""The folder `make test-gpu` takes to a GPU machine, and nothing else.

The machine has PyTorch with CUDA, numpy, cuda-bindings and pytest, no
network, and takes at most 64 MiB with it. So the bundle holds, per
release, the offload package (`vllm/v1/simple_kv_offload/`) of the bare
release and of its series, taken from git objects of a tree built from the
series; the scripts that run them (gpu_worker.py imports that package over
the stand-ins of gpu_standin.py, since the rest of vLLM would need
dependencies the machine lacks); and `manifest.json`: each tree's release,
kind and commit, whether its store must race (the release's series carries
the store barrier, so the bare release lacks it), and every file's sha256,
checked before a run.

Layout: trees/v<release>-<base|series>/vllm/v1/simple_kv_offload/*.py,
scripts/lib/ and scripts/prove/ (what test_gpu.py's run needs), README.txt,
manifest.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from keep.apply import scratch_tree
from lib.errors import ForkError
from lib.paths import ROOT, WORK, fresh_output_dir, rel
from lib.proc import git, git_bytes
from lib.series import Series, series_for_version

DEFAULT_DIR = WORK / "gpu-bundle"
DEFAULT_RELEASES = ("0.20.2", "0.23.0", "0.33.0")
LIMIT_BYTES = 64 * 2**20
OFFLOAD = "vllm/v1/simple_kv_offload"
# The patch whose absence from a release's series means upstream ordered
# the store after compute there (seed 004's fix, upstream from 0.24.0).
BARRIER_SUBJECT = "Order SimpleCPUOffload GPU->CPU stores after"
# What the run needs of scripts/, relative to it: the runner, its judge, the
# worker and its stand-ins, and the part of lib/ they import.
SCRIPTS = (
    "lib/__init__.py",
    "lib/cli.py",
    "lib/errors.py",
    "lib/paths.py",
    "prove/__init__.py",
    "prove/test_gpu.py",
    "prove/gpu_judge.py",
    "prove/gpu_worker.py",
    "prove/gpu_standin.py",
)
README = """\
The GPU check of vllm-fork's copy-versus-compute races (make test-gpu).

Needs: a machine with an NVIDIA GPU and a python3 with PyTorch (CUDA),
numpy and cuda-bindings. No network, no vLLM install: each tree's
vllm/v1/simple_kv_offload/ is imported over the stand-ins of
scripts/prove/gpu_standin.py.

Run, from this folder:
    python3 scripts/prove/test_gpu.py --out results
or from a checkout of the fork that carries this folder as .work/gpu-bundle:
    make test-gpu          (or: python3 scripts/prove/test_gpu.py)

It prints a table and exits non-zero if a series is not clean or a control
shows no race; results/ gets each tree's JSON, the worker logs and the
table. Without CUDA it says so in one line and exits 0.
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_size(folder: Path, limit: int = LIMIT_BYTES) -> int:
    """The folder's size in bytes; over `limit` is an error."""
    size = size_of(folder)
    if size > limit:
        raise ForkError(
            f"{rel(folder)}/ is {size / 2**20:.1f} MiB, over the "
            f"{limit / 2**20:.0f} MiB a GPU machine takes: bundle fewer releases"
        )
    return size


def store_race_expected(series: Series) -> bool:
    """The bare release lacks the store barrier: its series carries it."""
    return any(BARRIER_SUBJECT in p.subject() for p in series.patches())


def extract(repo: Path, ref: str, dest: Path) -> None:
    """`repo`'s offload package at `ref`, written under `dest`."""
    data = git_bytes(repo, "archive", "--format=tar", ref, "--", OFFLOAD)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        if not any(m.name.endswith("/worker.py") for m in members):
            raise ForkError(f"{ref} in {rel(repo)} has no {OFFLOAD}/worker.py")
        tar.extractall(dest, members=members, filter="data")


@contextlib.contextmanager
def built_trees(releases: list[str]) -> Iterator[list[tuple[Series, Path]]]:
    """Each release's series built in a throwaway tree (the upstream commit
    and the patches; the cache's objects borrowed), so that vllm/ and the
    trees `make test` uses are left alone."""
    series = [series_for_version(r) for r in releases]
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        yield [(s, scratch_tree(s, Path(tmp) / f"v{s.base().version}")) for s in series]


def build(
    dest: Path,
    sources: list[tuple[Series, Path]],
    limit: int = LIMIT_BYTES,
) -> dict:
    """Write the bundle into `dest` (emptied first, if a bundle was there)
    from each (series, tree built from it); returns the manifest."""
    if not sources:
        raise ForkError("no release to bundle")
    fresh_output_dir(dest, "The GPU bundle of make test-gpu")
    trees = []
    for series, repo in sources:
        version = series.base().version
        refs = {
            "base": (series.base().tree_ref, store_race_expected(series)),
            "series": ("HEAD", False),
        }
        for kind, (ref, race) in refs.items():
            name = f"v{version}-{kind}"
            extract(repo, ref, dest / "trees" / name)
            trees.append(
                {
                    "name": name,
                    "release": version,
                    "kind": kind,
                    "series": rel(series.dir),
                    "commit": git(repo, "rev-parse", f"{ref}^{{commit}}"),
                    "store_race_expected": race,
                    "path": f"trees/{name}",
                }
            )
    for script in SCRIPTS:
        target = dest / "scripts" / script
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "scripts" / script, target)
    (dest / "README.txt").write_text(README)
    files = {
        str(p.relative_to(dest)): sha256(p)
        for p in sorted(dest.rglob("*"))
        if p.is_file() and p.name != ".vllm-fork-output"
    }
    manifest = {
        "format": 1,
        "fork_commit": git(ROOT, "rev-parse", "HEAD", check=False) or None,
        "trees": trees,
        "files": files,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    check_size(dest, limit)
    return manifest
