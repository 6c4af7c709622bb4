"""What `make export` checks before it downloads or builds anything.

The series, `--patch`, the git identity the sign-off needs, and where
`--onto` comes from: a local ref of the tree, a local clone (`--upstream
DIR`: it must be a git repository that has the ref) or a URL (`git
ls-remote`, a few bytes, cut off after a short wait). Each failure says
how to go on, as a make command: without a clone or a network, the offline
form `make export VERSION=<release> ARGS="--onto upstream/v<release>"`
exports onto the release the series is based on, which the tree already
has. Only then does export build the tree and the test environment.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from keep.tree_release import tree_holds
from lib.errors import ForkError
from lib.paths import CACHE, DEFAULT_TREE, ROOT, rel
from lib.proc import git, git_ok
from lib.series import Series

GITHUB = "https://github.com/vllm-project/vllm.git"
# How long a remote may take to list its refs before export gives up on it.
LS_REMOTE_TIMEOUT_S = 20
HEX = re.compile(r"[0-9a-f]{7,40}")


def offline_command(series: Series) -> str:
    """The export that needs no clone and no network: onto the series' own
    release, which `make apply` fetched into the tree."""
    version = series.base().version
    return f'make export VERSION={version} ARGS="--onto upstream/v{version}"'


def is_url(upstream: str) -> bool:
    return "://" in upstream or bool(re.match(r"^[\w.-]+@[\w.-]+:", upstream))


def check_identity(tree: Path | None) -> str:
    """`Name <email>` for the Signed-off-by line vLLM's DCO check wants."""
    where = tree if tree is not None and (tree / ".git").exists() else ROOT
    name = git(where, "config", "user.name", check=False)
    email = git(where, "config", "user.email", check=False)
    if not name or not email:
        raise ForkError(
            "export adds a Signed-off-by line (vLLM requires the DCO) with your "
            "git identity, and git has no user.name or user.email. Set them:\n"
            '  git config --global user.name "Your Name"\n'
            "  git config --global user.email you@example.com"
        )
    return f"{name} <{email}>"


def check_patches(series: Series, only: list[str] | None) -> None:
    if only and not any(p.name.startswith(o) for p in series.patches() for o in only):
        names = ", ".join(p.name[:4] for p in series.patches())
        raise ForkError(
            f"no patch in {rel(series.dir)}/ starts with {', '.join(only)} "
            f"(its patches: {names})"
        )


def ls_remote(source: str, onto: str) -> tuple[bool, str]:
    """Whether `source` has the ref `onto` (or may have the commit), and
    git's message when it could not be asked."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true"}
    try:
        proc = subprocess.run(
            ["git", "ls-remote", source, onto],
            capture_output=True,
            text=True,
            timeout=LS_REMOTE_TIMEOUT_S,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer in {LS_REMOTE_TIMEOUT_S} s"
    if proc.returncode != 0:
        return False, proc.stderr.strip() or f"git ls-remote exited {proc.returncode}"
    if proc.stdout.strip() or HEX.fullmatch(onto):
        return True, ""
    return False, f"it has no branch or tag {onto!r}"


def check_onto(
    series: Series, tree: Path, onto: str, upstream: str | None, builds: bool
) -> None:
    """Refuse, before anything is downloaded, an --onto that cannot be had.
    `builds`: export builds `tree` from the series (which fetches the
    release it is based on into it)."""
    offline = offline_command(series)
    version = series.base().version
    has_tree = (tree / ".git").exists()
    if not builds and not has_tree:
        raise ForkError(
            f"{rel(tree)}/ is not a git checkout: export makes its branches "
            f"there. Run `make apply VERSION={version}` first (or give --tree)."
        )
    if upstream is None:
        if has_tree and git_ok(tree, "rev-parse", "-q", "--verify", onto):
            return
        if builds and onto == series.base().tag:
            return
        if onto == series.base().tag:  # the release, not fetched into this tree
            raise ForkError(
                f"{rel(tree)}/ has no {onto}: `make apply VERSION={version}` "
                f"fetches it (offline, from {rel(CACHE)}/ once downloaded), then "
                f"run `{offline}` again."
            )
        source = GITHUB
    elif is_url(upstream):
        source = upstream
    else:
        clone = Path(upstream).expanduser()
        if not clone.is_dir():
            raise ForkError(
                f"--upstream {upstream}: no such directory. Give it a clone of "
                "vLLM (git clone https://github.com/vllm-project/vllm.git), or "
                f"export offline onto the release the series is based on:\n"
                f"  {offline}\nNothing was downloaded or built."
            )
        if not git_ok(clone, "rev-parse", "--git-dir"):
            raise ForkError(
                f"--upstream {upstream} is not a git repository: give it a clone "
                f"of vLLM, or export offline:\n  {offline}\n"
                "Nothing was downloaded or built."
            )
        source = str(clone.resolve())
    found, why = ls_remote(source, onto)
    if found:
        return
    verb = "find" if why.startswith("it has no") else "reach"
    raise ForkError(
        f"cannot {verb} {onto!r} in {upstream or source} ({why}).\n"
        + (
            "Without --upstream, export fetches --onto from GitHub. "
            if upstream is None
            else ""
        )
        + 'Give --onto a branch or tag that exists there (ARGS="--upstream '
        '<clone of vLLM> --onto main"), or export offline onto the release '
        f"the series is based on:\n  {offline}\nNothing was downloaded or built."
    )


def why_this_series(series: Series, asked: bool) -> str:
    """Which series export takes, and why, for an operator whose tree holds
    another release."""
    version = series.base().version
    holding = tree_holds(DEFAULT_TREE)
    mine = holding.release if holding else None
    if asked:
        return f"exporting the {version} series ({rel(series.dir)}/), as asked"
    line = (
        f"exporting the {version} series ({rel(series.dir)}/), the newest: pull "
        "requests go to upstream main, and the newest series is the closest to it"
    )
    if mine and mine != version:
        line += (
            f". {rel(DEFAULT_TREE)}/ holds {mine}; `make export VERSION={mine}` "
            "exports that series instead (its patches may not apply to main)"
        )
    return line
