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
import os
import sys
from pathlib import Path

from common import ROOT, ForkError, main_guard, parser, rel, run, step

VENV = Path(os.environ.get("VLLM_FORK_VENV", ROOT / ".venv"))
DEFAULT_TORCH = "torch==2.13.0"
# What vLLM's pyproject.toml asks of a build, minus cmake/ninja (no kernels
# are compiled here: VLLM_TARGET_DEVICE=empty or VLLM_USE_PRECOMPILED=1).
BUILD_REQS = [
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "wheel",
    "packaging>=24.2",
    "jinja2",
]
# ruff matches the version vLLM's .pre-commit-config.yaml pins.
TEST_REQS = [
    "pytest==9.2.0",
    "pytest-asyncio==1.5.0",
    "hypothesis==6.170.15",
    "tblib==3.2.2",
    "ruff==0.14.0",
]


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _stamp_ok(venv: Path, level: str, reqs: list[str]) -> tuple[Path, str, bool]:
    digest = hashlib.sha256("\n".join(reqs).encode()).hexdigest()
    stamp = venv / f".fork-{level}.stamp"
    return stamp, digest, stamp.exists() and stamp.read_text() == digest


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
        raise ForkError(
            f"pip install into {rel(venv)} failed (exit {proc.returncode}); "
            "the output above says which package. Remove .venv to start over."
        )


def ensure_venv(
    level: str = "build", common_txt: Path | None = None, venv: Path = VENV
) -> Path:
    """Make sure `venv` has everything `level` needs; return its python."""
    torch = os.environ.get("TORCH_SPEC", DEFAULT_TORCH)
    reqs = [torch, *BUILD_REQS]
    if level == "test":
        if common_txt is None or not common_txt.is_file():
            raise ForkError("the test environment needs vLLM's requirements/common.txt")
        reqs += [*TEST_REQS, common_txt.read_text()]
    stamp, digest, ok = _stamp_ok(venv, level, reqs)
    if ok:
        return python(venv)
    if not python(venv).exists():
        step(f"creating {rel(venv)} ({sys.executable})")
        run([sys.executable, "-m", "venv", venv])
        pip_install(venv, ["-q", "--upgrade", "pip"])
    step(f"installing the {level} requirements into {rel(venv)} (a few minutes once)")
    pip_install(venv, ["-q", torch, *BUILD_REQS])
    if level == "test":
        assert common_txt is not None
        pip_install(venv, ["-q", *TEST_REQS, "-r", common_txt])
    stamp.write_text(digest)
    return python(venv)


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
