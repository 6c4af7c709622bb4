"""A script's command line: messages on stderr, the argument parser, and the
entry point that turns a ForkError into a message and an exit status."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, DEFAULT_TREE


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step(msg: str) -> None:
    say(f"==> {msg}")


def parser(
    description: str, *, series: str | None = None, tree: str | None = None
) -> argparse.ArgumentParser:
    """A script's argument parser: `description` (its docstring) printed by
    --help as written, and the two options most scripts take, each added
    when the script says what it is for: --series DIR (default: patches/)
    and --tree DIR (default: vllm/)."""
    p = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if series is not None:
        p.add_argument(
            "--series",
            type=Path,
            default=DEFAULT_SERIES,
            help=f"{series} (default: patches/)",
        )
    if tree is not None:
        p.add_argument(
            "--tree", type=Path, default=DEFAULT_TREE, help=f"{tree} (default: vllm/)"
        )
    return p


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
