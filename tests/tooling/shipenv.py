"""Helpers for the shipping tools' tests: upstream-like wheels, fresh venvs."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

from keep.build_digests import DIGESTS_FILE
from lib.paths import ROOT
from lib.proc import git, git_bytes
from lib.series import Series
from lib.testenv import package_env, pytest_cmd, read_junit

FAKE_TAGS = "cp38-abi3-manylinux_2_35_x86_64"
# Stands in for a compiled kernel: bytes that must come out unchanged.
FAKE_KERNEL = "vllm/_fork_test_kernels.abi3.so"


def record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [name, f"sha256={digest.decode()}", str(len(data))]


def build_upstream_like_wheel(tree: Path, series: Series, dest: Path) -> Path:
    """A wheel laid out as upstream's: the release's vllm/ from its tag, a
    generated _version.py, a fake compiled kernel, and a dist-info."""
    version = series.base().version
    tar = git_bytes(tree, "archive", "--format=tar", series.base().tag, "vllm")
    files: list[tuple[str, bytes, int]] = []
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            if m.isfile():
                data = t.extractfile(m).read()  # type: ignore[union-attr]
                files.append((m.name, data, 0o644))
    files.append(("vllm/_version.py", f"__version__ = '{version}'\n".encode(), 0o644))
    files.append((FAKE_KERNEL, random.Random(0).randbytes(300_000), 0o755))
    info = f"vllm-{version}.dist-info"
    # Named by version like the dist-info: repack must rename it too.
    files.append((f"vllm-{version}.data/data/share/vllm-fork-test.txt", b"x\n", 0o644))
    files += [
        (
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: upstream-like test wheel\n".encode(),
            0o644,
        ),
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: vllm-fork tests\n"
            b"Root-Is-Purelib: false\nTag: cp38-abi3-linux_x86_64\n",
            0o644,
        ),
        (f"{info}/top_level.txt", b"vllm\n", 0o644),
    ]
    rows = [record_row(name, data) for name, data, _ in files]
    rows.append([f"{info}/RECORD", "", ""])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    files.append((f"{info}/RECORD", buf.getvalue().encode(), 0o644))
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"vllm-{version}-{FAKE_TAGS}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in files:
            zi = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100000 | mode) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    return path


class Env:
    """A fresh virtual environment, as on a user's machine.

    Its own site-packages comes first; the project's .venv is appended (a
    .pth file) only to provide torch and vLLM's other dependencies, which
    this offline CPU machine cannot download: `pip install --no-deps`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(path)], check=True
        )
        self.python = path / "bin" / "python"
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        self.site = Path(self.eval(purelib))
        deps = sysconfig.get_paths()["purelib"]
        (self.site / "zz_vllm_fork_test_deps.pth").write_text(deps + "\n")

    def run(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """python -P (no cwd on sys.path: vllm/ in the checkout must not win)."""
        return subprocess.run(
            [str(self.python), "-P", *args],
            cwd=ROOT,
            env={**_base_env(), **package_env()},
            capture_output=True,
            text=True,
            check=check,
        )

    def run_shell(self, script: str) -> subprocess.CompletedProcess:
        """A shell command line with the same environment (e.g. a RUN line)."""
        return subprocess.run(
            ["bash", "-c", script],
            cwd=ROOT,
            env={**_base_env(), **package_env()},
            capture_output=True,
            text=True,
        )

    def eval(self, code: str) -> str:
        proc = subprocess.run(
            [str(self.python), "-P", "-c", code], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def pip_install(self, wheel: Path) -> None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(self.python),
                "--disable-pip-version-check",
                "install",
                "-q",
                "--no-deps",
                # Bytecode for 1700 modules would take most of the time.
                "--no-compile",
                str(wheel),
            ],
            check=True,
        )

    def check_patched(self) -> Path:
        """Run vllm._fork's checks (the build digests of every file the
        series changes, the patched names); return where the patched module
        came from."""
        proc = self.run(
            "-c",
            "import vllm._fork as fork, vllm.v1.core.kv_cache_utils as m\n"
            "assert not fork.missing_markers(), fork.missing_markers()\n"
            "record = fork.build_record()\n"
            "assert record and record['files'], 'no build digests'\n"
            "assert not fork.file_problems(record), fork.file_problems(record)\n"
            "print(m.__file__)",
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return Path(proc.stdout.strip().splitlines()[-1])

    def record_problems(self) -> list[str]:
        """Installed files that do not match the installed RECORD."""
        code = (
            "import base64, hashlib, importlib.metadata as md, json\n"
            "bad = []\n"
            "for f in md.distribution('vllm').files:\n"
            "    if f.hash is None: continue\n"
            "    data = f.read_binary()\n"
            "    d = base64.urlsafe_b64encode(hashlib.sha256(data).digest())\n"
            "    if d.rstrip(b'=').decode() != f.hash.value or len(data) != f.size:\n"
            "        bad.append(str(f))\n"
            "print(json.dumps(bad))\n"
        )
        return json.loads(self.eval(code))

    def run_tests(self, test_ids: list[str], junit: Path) -> dict[str, str]:
        """Run tests (e.g. reproducers) against the installed vllm."""
        cmd = pytest_cmd(self.python, junit, *test_ids)
        proc = self.run(*cmd[1:])
        outcomes = read_junit(junit)
        assert outcomes, proc.stdout[-3000:] + proc.stderr[-3000:]
        return outcomes


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def patch_paths(series: Series) -> set[str]:
    """Files the series' patch texts and overlay change, read from the files
    themselves (not from git), to check the tools against; and the build
    digests `make apply` writes beside the overlay."""
    paths = set()
    for p in series.patches():
        for line in p.path.read_text().splitlines():
            if line.startswith("diff --git a/"):
                paths.add(line.split(" b/", 1)[1])
    return paths | {str(f) for f in series.overlay_files()} | {DIGESTS_FILE}


def reproducer_ids(series: Series) -> list[str]:
    return [t for p in series.patches() for t in p.reproducers()]


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD")


def commit_files(
    repo: Path,
    parent: str,
    files: dict[str, str | None],
    message: str,
    author: str = "Up Stream <up@example.com>",
) -> str:
    """A commit on `parent` changing `files` (None deletes), without a checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        name, email = author[:-1].split(" <")
        env |= {
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_COMMITTER_NAME": name,
            "GIT_COMMITTER_EMAIL": email,
            "GIT_AUTHOR_DATE": "1767225600 +0000",
            "GIT_COMMITTER_DATE": "1767225600 +0000",
        }
        git(repo, "read-tree", parent, env=env)
        for path, text in files.items():
            if text is None:
                git(repo, "update-index", "--force-remove", path, env=env)
                continue
            blob = git(repo, "hash-object", "-w", "--stdin", input=text)
            entry = f"100644,{blob},{path}"
            git(repo, "update-index", "--add", "--cacheinfo", entry, env=env)
        tree = git(repo, "write-tree", env=env)
        return git(repo, "commit-tree", tree, "-p", parent, "-m", message, env=env)


def shared_clone(source: Path, dest: Path) -> Path:
    """A clone borrowing `source`'s objects, without a checkout (fast)."""
    git(source, "clone", "-q", "--shared", "--no-checkout", str(source), str(dest))
    # The tree keeps the upstream base as refs/remotes/upstream/v<ver>, which
    # a clone leaves behind.
    git(
        dest,
        "fetch",
        "-q",
        str(source),
        "+refs/remotes/upstream/*:refs/remotes/upstream/*",
    )
    return dest


def blob_text(repo: Path, rev: str, path: str) -> str:
    return git_bytes(repo, "show", f"{rev}:{path}").decode()
