"""Every script answers --help, and the options most of them share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lib.cli import parser
from lib.paths import DEFAULT_SERIES, DEFAULT_TREE

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CLIS = sorted(
    str(p.relative_to(SCRIPTS))
    for p in SCRIPTS.rglob("*.py")
    if "main_guard(main)" in p.read_text()
)


def test_there_are_scripts():
    assert {
        "keep/apply.py",
        "keep/fetch.py",
        "keep/refresh.py",
        "prove/run_tests.py",
        "ship/install.py",
        "lib/venv.py",
    } <= set(CLIS)


@pytest.mark.parametrize("script", CLIS)
def test_help(script):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    assert len(proc.stdout.splitlines()) > 3


def test_the_shared_options_are_added_when_asked_for():
    args = parser("what it does", series="series to x", tree="tree to y").parse_args([])
    assert (args.series, args.tree) == (DEFAULT_SERIES, DEFAULT_TREE)
    assert vars(parser("what it does").parse_args([])) == {}
    helped = parser("what it does", tree="checkout to build").format_help()
    assert "checkout to build (default: vllm/)" in helped
