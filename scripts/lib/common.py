"""Shared plumbing for the fork's tooling: paths, errors, subprocess and git."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SERIES = ROOT / "patches"
DEFAULT_TREE = ROOT / "vllm"
OVERLAY = ROOT / "overlay"
CACHE = Path(os.environ.get("VLLM_FORK_CACHE", ROOT / ".cache"))
WORK = ROOT / ".work"
DIST = ROOT / "dist"
# Marks a directory a tool writes whole (a build context, an export), so a
# later run may empty it while refusing to empty anything else.
OUTPUT_MARKER = ".vllm-fork-output"

# Commits the tooling makes (upstream imports, applied patches, the overlay)
# use a fixed identity, so the same inputs give the same commit ids anywhere.
TOOL_NAME = "vllm-fork tooling"
TOOL_EMAIL = "tooling@vllm-fork.invalid"


class ForkError(Exception):
    """An error the user can act on: printed without a traceback."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step(msg: str) -> None:
    say(f"==> {msg}")


def run(
    cmd: Sequence[str | os.PathLike],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    capture: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a command; on failure raise ForkError with its output."""
    full_env = None if env is None else {**os.environ, **env}
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env=full_env,
            text=True,
            input=input,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.PIPE if capture else None,
        )
    except FileNotFoundError as e:
        raise ForkError(f"'{cmd[0]}' is not installed or not on PATH") from e
    if check and proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or "")).strip()
        raise ForkError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}"
            + (f"\n{out}" if out else "")
        )
    return proc


def tool_identity_env(date: str | None = None) -> dict[str, str]:
    env = {
        "GIT_AUTHOR_NAME": TOOL_NAME,
        "GIT_AUTHOR_EMAIL": TOOL_EMAIL,
        "GIT_COMMITTER_NAME": TOOL_NAME,
        "GIT_COMMITTER_EMAIL": TOOL_EMAIL,
    }
    if date:
        env["GIT_AUTHOR_DATE"] = date
        env["GIT_COMMITTER_DATE"] = date
    return env


def git(
    repo: Path,
    *args: str | os.PathLike,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> str:
    """Run git in `repo` and return stdout without the trailing newline."""
    proc = run(["git", "-C", repo, *args], check=check, env=env, input=input)
    return proc.stdout.rstrip("\n")


def git_bytes(repo: Path, *args: str | os.PathLike) -> bytes:
    """Run git in `repo` and return its raw stdout (file contents)."""
    proc = subprocess.run(
        ["git", "-C", str(repo), *map(str, args)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise ForkError(
            f"command failed ({proc.returncode}): git -C {repo} "
            f"{' '.join(map(str, args))}\n{proc.stderr.decode(errors='replace')}"
        )
    return proc.stdout


def git_ok(repo: Path, *args: str) -> bool:
    return run(["git", "-C", repo, *args], check=False).returncode == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel(path: Path) -> str:
    """A path as the user would type it from the repository root."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def fresh_output_dir(path: Path, what: str) -> Path:
    """Empty `path` for a tool to write `what` into; never delete user files.

    A directory that exists, is not empty and lacks the marker a previous
    run left is refused: it is not ours to delete.
    """
    if path.exists():
        if not path.is_dir():
            raise ForkError(f"{rel(path)} is a file: pass another output directory")
        if any(path.iterdir()) and not (path / OUTPUT_MARKER).exists():
            raise ForkError(
                f"{rel(path)}/ exists and was not written by vllm-fork, so it was "
                "left alone. Pass another output directory, or remove it yourself."
            )
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / OUTPUT_MARKER).write_text(
        f"{what}, written by vllm-fork: the next run replaces this directory.\n"
    )
    return path


def parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main_guard(fn: Callable[[], int | None]) -> None:
    """Run a CLI entry point: ForkError becomes a one-paragraph message."""
    start = time.monotonic()
    # A SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so that what a
    # script started (servers, worktrees) is stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = fn() or 0
    except ForkError as e:
        say(f"error: {e}")
        code = 1
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    if os.environ.get("VLLM_FORK_TIMING"):
        say(f"({time.monotonic() - start:.1f}s)")
    sys.exit(code)
