#!/usr/bin/env python3
"""Create or update the project's virtual environment (.venv).

Two levels, each installed once and recorded in a stamp file:
  build  torch and what vLLM's setup.py needs with --no-build-isolation
  test   build + vLLM's requirements/common.txt + the test tools

TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU
build this project's machines carry on disk; on a GPU machine `make install`
uses the torch version the base release pins).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lib.cli import main_guard, parser, say, step
from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import run

VENV = Path(os.environ.get("VLLM_FORK_VENV", ROOT / ".venv"))
# Test environments for releases whose requirements .venv does not meet.
RELEASE_VENVS = WORK / "venvs"
# Requirements of some release that no package on PyPI can meet, and what is
# installed instead. Only what upstream's scheduler tests do not exercise.
RELAXED = {
    # 0.33.0 asks certifi>=2026.10.19; the newest on PyPI is 2026.10.18.
    # certifi is only the CA bundle: no test here opens a TLS connection.
    "certifi": "certifi",
}
DEFAULT_TORCH = "torch==2.13.0"
# What a new test environment takes on disk, measured (2026-12-07): 2.7 GB
# (triton, which xgrammar requires, 1.0 GB; torch 0.75 GB), plus pip's
# unpacking. A fresh clone's `make test` builds two (.venv and 0.33.0's).
ENV_BYTES = 3_500_000_000
# What vLLM's pyproject.toml asks of a build, minus cmake/ninja (no kernels
# are compiled here: VLLM_TARGET_DEVICE=empty or VLLM_USE_PRECOMPILED=1).
# setup.py imports setuptools-rust from 0.24.0 on (its Rust extensions are
# optional: none is built here).
BUILD_REQS = [
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "setuptools-rust>=1.9.0",
    "wheel",
    "packaging>=24.2",
    "jinja2",
]
# ruff matches the version vLLM's .pre-commit-config.yaml pins.
TEST_REQS = [
    "pytest==9.2.0",
    "pytest-asyncio==1.5.0",
    # make test's project tests on every core (they are git and subprocess
    # bound: 8 minutes on one core of a slow 2-core machine, 5 on two).
    "pytest-xdist==3.8.0",
    "hypothesis==6.170.15",
    "tblib==3.2.2",
    "ruff==0.14.0",
]


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def requirement_name(line: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def adapted_requirements(common_txt: Path) -> str:
    """A release's requirements/common.txt with the RELAXED lines replaced."""
    lines = []
    for line in common_txt.read_text().splitlines():
        name = requirement_name(line.split("#", 1)[0])
        if name in RELAXED:
            lines.append(f"{RELAXED[name]}  # relaxed by vllm-fork: {line.strip()}")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _stamp_ok(venv: Path, level: str, reqs: list[str]) -> tuple[Path, str, bool]:
    digest = hashlib.sha256("\n".join(reqs).encode()).hexdigest()
    stamp = venv / f".fork-{level}.stamp"
    return stamp, digest, stamp.exists() and stamp.read_text() == digest


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest
    existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full_message(venv: Path, need: int, level: str = "test") -> str:
    free = free_bytes(venv)
    return (
        f"only {free / 1e9:.1f} GB free on the disk that holds {rel(venv)}; "
        f"a {level} environment takes about {need / 1e9:.1f} GB. Free space "
        "(`make clean` removes .work/: its trees, logs and the releases' "
        f"environments, {rel(RELEASE_VENVS)}), then run the same command again."
    )


def pip_install(venv: Path, args: list[str]) -> None:
    proc = run(
        [
            python(venv),
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            *args,
        ],
        capture=False,
        check=False,
    )
    if proc.returncode != 0:
        if free_bytes(venv) < 500_000_000:
            # pip's own line ("[Errno 28] No space left on device") is buried
            # under its warnings; say it, and what to remove.
            raise ForkError(
                f"pip install into {rel(venv)} failed: the disk is full; "
                + disk_full_message(venv, ENV_BYTES)
            )
        raise ForkError(
            f"pip install into {rel(venv)} failed (exit {proc.returncode}); "
            f"the output above says which package. Remove {rel(venv)} to "
            "start over."
        )


def installed(name: str, venv: Path = VENV) -> tuple[str, Path | None] | None:
    """The version of `name` installed in `venv` and, for an editable
    install (pip install -e), the directory it runs from; None if absent.
    Read from the files pip wrote, without starting Python."""
    for dist in sorted(venv.glob(f"lib/python3*/site-packages/{name}-*.dist-info")):
        meta = dist / "METADATA"
        if not meta.is_file():
            continue
        m = re.search(r"^Version: (\S+)", meta.read_text(errors="replace"), re.M)
        if not m:
            continue
        source = None
        try:
            url = json.loads((dist / "direct_url.json").read_text())
            if url.get("dir_info", {}).get("editable"):
                source = Path(url["url"].removeprefix("file://"))
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        return m.group(1), source
    return None


def ensure_venv(
    level: str = "build", common_txt: Path | None = None, venv: Path = VENV
) -> Path:
    """Make sure `venv` has everything `level` needs; return its python."""
    torch = os.environ.get("TORCH_SPEC", DEFAULT_TORCH)
    reqs = [torch, *BUILD_REQS]
    if level == "test":
        if common_txt is None or not common_txt.is_file():
            raise ForkError("the test environment needs vLLM's requirements/common.txt")
        reqs += [*TEST_REQS, adapted_requirements(common_txt)]
    stamp, digest, ok = _stamp_ok(venv, level, reqs)
    if ok:
        return python(venv)
    # Checked before pip starts: a disk that fills half-way leaves an
    # environment without its stamp (reinstalled next time, nothing lost),
    # but only after minutes and a message pip buries under its warnings.
    need = ENV_BYTES if level == "test" else ENV_BYTES // 2
    if free_bytes(venv) < need and not python(venv).exists():
        raise ForkError(disk_full_message(venv, need, level))
    if not python(venv).exists():
        step(f"creating {rel(venv)} ({sys.executable})")
        # -I: not scripts/lib/venv.py, whatever the current directory.
        run([sys.executable, "-I", "-m", "venv", venv])
        pip_install(venv, ["-q", "--upgrade", "pip"])
    step(f"installing the {level} requirements into {rel(venv)} (a few minutes once)")
    pip_install(venv, ["-q", torch, *BUILD_REQS])
    if level == "test":
        req_file = venv / "fork-requirements.txt"
        req_file.write_text(reqs[-1])
        pip_install(venv, ["-q", *TEST_REQS, "-r", req_file])
    stamp.write_text(digest)
    return python(venv)


def satisfies(python_bin: Path, common_txt: Path) -> bool:
    """Whether an environment already meets a release's requirements: pip
    resolves them against what is installed, offline, and installs nothing."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        req.write(adapted_requirements(common_txt))
        req.flush()
        proc = run(
            [
                python_bin,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--no-index",
                "--quiet",
                "--report",
                "-",
                "-r",
                req.name,
            ],
            check=False,
        )
    if proc.returncode != 0:
        return False
    try:
        return not json.loads(proc.stdout).get("install")
    except json.JSONDecodeError:
        return False


def release_venv(version: str, common_txt: Path) -> Path:
    """The python of a test environment that meets a release's requirements.

    .venv when it does, else an environment under .work/venvs/ that already
    does (releases close together share one), else a new
    .work/venvs/vllm-<version>. Releases pin different versions (0.19.0
    wants transformers<5, 0.24.0 and later compressed-tensors 0.17.0...), so
    one environment cannot meet them all."""
    candidates = [VENV, *sorted(p for p in RELEASE_VENVS.glob("*") if p.is_dir())]
    for venv in candidates:
        if (venv / ".fork-test.stamp").exists() and satisfies(python(venv), common_txt):
            return python(venv)
    target = RELEASE_VENVS / f"vllm-{version}"
    say(f"    {version}: no test environment meets its requirements; {rel(target)}")
    return ensure_venv("test", common_txt, venv=target)


def series_venv(version: str, common_txt: Path, default: bool) -> Path:
    """The python to test a series on `version` with: .venv, made to meet
    the release's requirements, for the default series; for another
    release's series an environment that meets its own (release_venv), so
    that a run on another release never reinstalls .venv."""
    if default:
        return ensure_venv("test", common_txt)
    return release_venv(version, common_txt)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("level", choices=("build", "test"), nargs="?", default="build")
    p.add_argument(
        "--common-txt",
        type=Path,
        help="vLLM's requirements/common.txt (for the test level)",
    )
    args = p.parse_args()
    print(ensure_venv(args.level, args.common_txt))
    return 0


if __name__ == "__main__":
    main_guard(main)
