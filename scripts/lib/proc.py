"""Running commands and git for the fork's tooling: a failure is a ForkError
with the command's output."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from lib.errors import ForkError

# Commits the tooling makes (upstream imports, applied patches, the overlay)
# use a fixed identity, so the same inputs give the same commit ids anywhere.
TOOL_NAME = "vllm-fork tooling"
TOOL_EMAIL = "tooling@vllm-fork.invalid"


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
