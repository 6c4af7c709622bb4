"""Every command a message tells the user to run works as printed, through
make (issue 41: the backup-branch hint said `make refresh`, which failed
with "pass --series", a flag of the script that make does not take)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Upstream, git

from keep.apply import apply_series, make_hint, series_variable
from keep.refresh import refresh_series
from lib.errors import ForkError
from lib.paths import DEFAULT_SERIES, DEFAULT_TREE, ROOT
from lib.series import Series

SCRIPTS = ROOT / "scripts"
MAKEFILE = (ROOT / "Makefile").read_text()
TARGETS = set(re.findall(r"^([a-z0-9-]+):", MAKEFILE, re.M))
# The variables the Makefile reads: $(NAME) and $(origin NAME).
VARIABLES = set(re.findall(r"\$\((?:origin )?([A-Z_]+)\)", MAKEFILE))


def strings(path: Path):
    """(line, text) of every string literal in a script; an f-string's
    replacement fields become {}."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            parts = [
                v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
            ]
            yield node.lineno, "".join(parts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def make_commands():
    """Every `make ...` a script's text puts in backticks or after `&&`."""
    for path in sorted(SCRIPTS.rglob("*.py")):
        for line, text in strings(path):
            for m in re.finditer(r"`(make [^`]*)`|&& (make [a-z-]+[^\n;`]*)", text):
                yield f"{path.relative_to(ROOT)}:{line}", (m.group(1) or m.group(2))


def problems_of(command: str) -> list[str]:
    words = command.split()
    found = []
    target = words[1]
    if target not in TARGETS and target != "{}":
        found.append(f"no target {target}")
    rest = re.sub(r'ARGS=("[^"]*"|\S+)', "", " ".join(words[2:]))
    for word in rest.split():
        if word.startswith("-"):
            found.append(f"a script's flag {word} (make takes variables)")
        elif (m := re.match(r"([A-Z_]+)=", word)) and m.group(1) not in VARIABLES:
            found.append(f"make reads no {m.group(1)}")
    return found


def test_every_make_command_in_a_message_is_one_make_runs():
    commands = list(make_commands())
    assert len(commands) > 30  # the scan finds them
    bad = [
        f"{where}: `{cmd}`: {', '.join(problems_of(cmd))}"
        for where, cmd in commands
        if problems_of(cmd)
    ]
    assert not bad, "\n".join(bad)


def test_no_message_tells_to_pass_a_series_flag():
    told = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(SCRIPTS.rglob("*.py"))
        for line, text in strings(path)
        if re.search(r"\bpass --(series|version|tree)\b", text)
    ]
    assert not told


def test_hints_name_the_series_by_makes_variables():
    assert series_variable(Series(DEFAULT_SERIES)) == "VERSION=0.20.2"
    v28 = Series(DEFAULT_SERIES / "v0.28.0")
    assert series_variable(v28) == "VERSION=0.28.0"
    assert make_hint("refresh", DEFAULT_TREE, v28) == "make refresh VERSION=0.28.0"
    other = Path("/tmp/elsewhere")
    assert make_hint("apply", other, v28) == f"make apply VERSION=0.28.0 TREE={other}"


def run_make(command: str) -> subprocess.CompletedProcess:
    """A hint's make command, run as the user would (from the root)."""
    return subprocess.run(
        [*command.split(), "-s", "-C", str(ROOT), f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
    )


@pytest.fixture
def backup(upstream: Upstream, capsys) -> tuple[Upstream, str]:
    """A user commit kept on a backup branch by a rebuild; the hint."""
    upstream.add_patch("vllm/v1/core/new.py", "x = 1\n", "Add new.py")
    upstream.commit_in_tree("vllm/mine.py", "mine = True\n", "My experiment")
    upstream.series.overlay.joinpath("vllm/_fork.py").write_text("FORK = 'v2'\n")
    capsys.readouterr()
    apply_series(upstream.series, upstream.tree, upstream.cache)
    err = capsys.readouterr().err
    hint = re.search(r"To add them to the series: (.*)", err).group(1)
    return upstream, hint


def test_the_backup_hint_works_as_printed(backup):
    up, hint = backup
    checkout, make = hint.split(" && ")
    assert make.startswith("make refresh SERIES=") and "--" not in make
    subprocess.run(checkout.split(), check=True)
    done = run_make(make)
    assert done.returncode == 0, done.stderr
    names = [p.name for p in up.series.patches()]
    assert names == ["0001-Add-new.py.patch", "0002-My-experiment.patch"]


def test_a_refresh_of_another_release_names_the_one_the_tree_holds(upstream: Upstream):
    apply_series(upstream.series, upstream.tree, upstream.cache)
    other = Series(DEFAULT_SERIES / "v0.28.0")
    with pytest.raises(ForkError) as info:
        refresh_series(other, upstream.tree)
    msg = str(info.value)
    assert "pass --series" not in msg
    assert f"make refresh SERIES={upstream.series.dir}" in msg
    assert "make apply VERSION=0.28.0" in msg  # no such branch in the tree yet


def test_the_conflict_steps_name_the_series(upstream: Upstream):
    upstream.add_patch(
        "vllm/v1/core/kv_cache_utils.py", "def popleft_n(n):\n    pass\n", "Edit"
    )
    git(upstream.tree, "reset", "-q", "--hard", "HEAD~1")  # drop the overlay
    (upstream.tree / "vllm/v1/core/kv_cache_utils.py").write_text("mine\n")
    with pytest.raises(ForkError) as info:
        apply_series(upstream.series, upstream.tree, upstream.cache)
    assert f"make refresh SERIES={upstream.series.dir}" in str(info.value)
