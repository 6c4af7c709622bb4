#!/usr/bin/env python3
"""Install the patched tree into .venv in editable mode, compiling nothing.

This is `pip install -e vllm` with the variables vLLM's setup.py needs on
this machine, printed before it runs:
  CPU only (no nvidia-smi):  VLLM_TARGET_DEVICE=empty
  NVIDIA GPU:                VLLM_USE_PRECOMPILED=1 and
                             VLLM_PRECOMPILED_WHEEL_LOCATION=<upstream's wheel
                             of the same release, from `pip download`>, with
                             the torch version that release pins
Both use --no-build-isolation: the build requirements are already in .venv
(an isolated build would download the CUDA torch pyproject.toml pins).

The installed package says what it is: VLLM_VERSION_OVERRIDE (read by
vLLM's setup.py) sets its version to the release the tree holds with the
fork's label, as the patched wheel has it, and vLLM's device suffix:
0.28.0+fork.10.g1a2b3c4d.empty (pip show vllm, vllm.__version__). An
editable install keeps that version until it is installed again: after
`make apply VERSION=<another release>`, `make install` (apply says so).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # python3 scripts/<job>/<name>.py: import from scripts/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from keep.tree_release import OVERLAY_SUBJECT, tree_holds
from lib.cli import main_guard, parser, say
from lib.errors import ForkError
from lib.paths import CACHE, rel
from lib.proc import git, run
from lib.venv import VENV, ensure_venv, pip_install

# What vLLM's setup.py appends to the version for each way of installing.
DEVICE_SUFFIX = {"cpu": "empty", "cuda": "precompiled"}


def detect_device() -> str:
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def tree_version(tree: Path) -> str:
    """The upstream release the tree is built on, from its vX.Y.Z tag."""
    tag = run(
        ["git", "-C", tree, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*"],
        check=False,
    ).stdout.strip()
    if not tag:
        raise ForkError(f"{rel(tree)}/ has no vX.Y.Z tag: run `make apply` first")
    return tag[1:]


def pinned_torch(tree: Path) -> str:
    """The torch requirement of the release's CUDA build."""
    text = (tree / "requirements" / "cuda.txt").read_text()
    m = re.search(r"^torch\s*==\s*([0-9.]+)", text, re.M)
    if not m:
        raise ForkError(f"no torch pin in {rel(tree)}/requirements/cuda.txt")
    return f"torch=={m.group(1)}"


def upstream_wheel(python: Path, version: str) -> Path:
    dest = CACHE / "wheels"
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[-1]
    say(f"    downloading upstream's vllm {version} wheel (precompiled kernels)")
    run(
        [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            f"vllm=={version}",
            "-d",
            dest,
        ],
        capture=False,
    )
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise ForkError(f"pip download left no vllm {version} wheel in {rel(dest)}")
    return found[-1]


def install_env(device: str, tree: Path) -> tuple[Path, dict[str, str]]:
    if device == "cpu":
        return ensure_venv("build"), {"VLLM_TARGET_DEVICE": "empty"}
    os.environ["TORCH_SPEC"] = pinned_torch(tree)
    python = ensure_venv("build")
    wheel = upstream_wheel(python, tree_version(tree))
    return python, {
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
    }


def fork_version(tree: Path, device: str) -> str:
    """The version the install reports: <release>+fork.<patches>.g<series
    fingerprint>.<device suffix>; `.edited` before the suffix when commits
    sit on top of the build (make refresh, make apply to put them in)."""
    holding = tree_holds(tree)
    if holding is None or not holding.complete or not holding.fingerprint:
        raise ForkError(
            f"{rel(tree)}/ is not a finished `make apply` build: run `make apply` "
            "(VERSION=<release> for another release) first"
        )
    base = f"upstream/v{holding.release}"
    subjects = git(tree, "log", "--format=%s", f"{base}..HEAD").splitlines()
    patches = [s for s in subjects if not s.startswith(OVERLAY_SUBJECT)]
    edited = not (subjects and subjects[0].startswith(OVERLAY_SUBJECT))
    label = f"fork.{len(patches)}.g{holding.fingerprint[:8]}"
    if edited:
        label += ".edited"
    return f"{holding.release}+{label}.{DEVICE_SUFFIX[device]}"


def main() -> int:
    p = parser(__doc__, tree="patched checkout to install")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: no kernels; cuda: upstream's precompiled kernels",
    )
    args = p.parse_args()
    tree = args.tree.resolve()
    if not (tree / "setup.py").is_file():
        raise ForkError(f"{rel(tree)}/ is not a vLLM tree: run `make apply` first")
    device = detect_device() if args.device == "auto" else args.device
    python, env = install_env(device, tree)
    env["VLLM_VERSION_OVERRIDE"] = fork_version(tree, device)
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    say(f"==> {shown} {rel(VENV)}/bin/pip install --no-build-isolation -e {rel(tree)}")
    os.environ.update(env)
    pip_install(VENV, ["--no-build-isolation", "-e", str(tree)])
    # -I: not the checkout's vllm/ directory (a namespace package from the
    # repository's root), only what the install put on the path.
    version = run([python, "-I", "-c", "import vllm; print(vllm.__version__)"]).stdout
    holding = tree_holds(tree)
    say(
        f"installed vllm {version.strip()} (release {holding.release}, series "
        f"{holding.series_dir or '?'}/ {holding.fingerprint})"
    )
    return 0


if __name__ == "__main__":
    main_guard(main)
