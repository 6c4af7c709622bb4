"""make mutate's parts that need no vLLM: what counts as a code change,
which patch wrote a line, which operators make mutants."""

from __future__ import annotations

import re
import shlex
import tomllib

from conftest import git

from lib.series import find_series
from prove import mutate, mutate_operators
from prove.mutate import code_of, hunks_of
from prove.mutate_operators import (
    EXCLUDED_OPERATORS,
    blame,
    claim_holds_on,
    is_mutation_subject,
    write_config,
)

BEFORE = '''
def f(x: int) -> int:
    """Twice x."""
    # a comment
    return 2 * x
'''


def test_docstrings_comments_and_annotations_are_not_code():
    assert code_of(BEFORE) == code_of(
        'def f(x: str) -> bool:\n    """Other words."""\n    return 2 * x\n'
    )


def test_a_changed_expression_is_code():
    assert code_of(BEFORE) != code_of("def f(x: int) -> int:\n    return 3 * x\n")
    assert code_of(BEFORE) != code_of(
        'def f(x: int) -> int:\n    """Twice x."""\n    return 2 * x\n    pass\n'
    )


def test_blame_names_the_patch_that_wrote_each_line(tmp_path):
    repo = tmp_path / "tree"
    repo.mkdir()
    git(repo, "init", "-q")
    f = repo / "m.py"
    f.write_text("a = 1\nb = 2\nc = 3\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "Import upstream")
    git(repo, "update-ref", "refs/remotes/upstream/v1", "HEAD")
    f.write_text("a = 1\nb = 20\nc = 3\n")
    git(repo, "commit", "-qam", "[Core] first patch")
    f.write_text("a = 1\nb = 20\nc = 3\nd = 4\n")
    git(repo, "commit", "-qam", "[Core] second patch")
    assert blame(repo, "upstream/v1", "m.py") == {
        2: "[Core] first patch",
        4: "[Core] second patch",
    }


def test_only_vllms_code_is_mutated_not_the_tests_a_patch_carries():
    assert is_mutation_subject("vllm/v1/core/block_pool.py")
    assert not is_mutation_subject("tests/v1/core/test_typed_pool_errors.py")
    assert not is_mutation_subject("vllm/_fork.py")
    assert not is_mutation_subject("vllm/v1/core/README.md")


def test_hunks_of_skips_a_test_file_the_patch_carries(tmp_path):
    repo = tmp_path / "tree"
    (repo / "vllm").mkdir(parents=True)
    (repo / "tests").mkdir()
    code = repo / "vllm" / "m.py"
    code.write_text("a = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "Import upstream")
    git(repo, "update-ref", "refs/remotes/upstream/v1", "HEAD")
    code.write_text("a = 2\n")
    (repo / "tests" / "test_m.py").write_text("def test_a():\n    pass\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "[Core] a patch with its test")
    assert [h.file for h in hunks_of(repo, "upstream/v1")] == ["vllm/m.py"]


def excluded(name: str) -> bool:
    """cr-filter-operators' own test of an operator against the list."""
    pattern = re.compile("|".join(f"(:?{e})" for e in EXCLUDED_OPERATORS))
    return pattern.match(name) is not None


def test_operators_kept_negate_loosen_or_move_by_one():
    kept = [
        "core/AddNot",
        "core/ReplaceUnaryOperator_Delete_Not",
        "core/ReplaceComparisonOperator_Gt_GtE",
        "core/ReplaceComparisonOperator_Eq_NotEq",
        "core/ReplaceComparisonOperator_IsNot_Is",
        "core/ReplaceBinaryOperator_Add_Sub",
        "core/NumberReplacer",
        "core/ZeroIterationForLoop",
    ]
    dropped = [
        "core/ReplaceBinaryOperator_Add_Pow",
        "core/ReplaceBinaryOperator_Add_Sub2",
        "core/ReplaceComparisonOperator_Gt_Eq",
        "core/ReplaceComparisonOperator_Eq_Is",
        "core/ReplaceUnaryOperator_USub_Invert",
    ]
    assert [n for n in kept if excluded(n)] == []
    assert [n for n in dropped if not excluded(n)] == []


def test_cosmic_ray_config_keeps_a_quoted_test_command(tmp_path):
    # The test command is `sh -c '...'`: a TOML literal string broke on it.
    command = "sh -c " + shlex.quote("pytest 'a b' && oracle \"x\"")
    path = tmp_path / "cr.toml"
    write_config(path, ["m.py"], "upstream/v1", command, 600.0, ["http://h:1"])
    config = tomllib.loads(path.read_text())["cosmic-ray"]
    assert config["test-command"] == command
    assert config["distributor"]["http"]["worker-urls"] == ["http://h:1"]
    assert config["filters"]["git-filter"]["branch"] == "upstream/v1"


def test_every_equivalence_claim_names_a_patch_of_a_series():
    """A claim keyed by a subject no patch has any more matches nothing, and
    the mutant it explained counts as a survivor again (0002's were, after
    its subject changed)."""
    subjects = [p.subject() for s in find_series() for p in s.patches()]
    claims = [key[0] for key in mutate.EQUIVALENT] + [
        key[0] for key in mutate_operators.EQUIVALENT
    ]
    stale = [c for c in claims if not any(c in subject for subject in subjects)]
    assert not stale


def test_a_claim_that_names_a_release_holds_on_that_release_only():
    assert claim_holds_on("0.20.2: nothing calls it", "upstream/v0.20.2")
    assert not claim_holds_on("0.20.2: nothing calls it", "upstream/v0.33.0")
    assert claim_holds_on("no release named", "upstream/v0.33.0")


def test_reverting_a_file_the_patch_adds_runs_the_suite(tmp_path, monkeypatch):
    """A patch's new module is one hunk: reverted, the file is gone. The
    mutant is run (its importers fail), and the file comes back after."""
    repo = tmp_path / "tree"
    (repo / "vllm").mkdir(parents=True)
    (repo / "vllm" / "m.py").write_text("a = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "Import upstream")
    git(repo, "update-ref", "refs/remotes/upstream/v1", "HEAD")
    added = repo / "vllm" / "new.py"
    added.write_text("def f():\n    return 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "[Core] a patch with a new module")
    (hunk,) = hunks_of(repo, "upstream/v1")
    ran = []
    monkeypatch.setattr(
        mutate, "run_suite", lambda *args: ran.append(added.exists()) or ("killed", "")
    )
    outcome = mutate.try_one(hunk, repo, repo / "python", [], repo)
    assert outcome.state == "killed"
    assert ran == [False], "the suite ran with the file reverted away"
    assert added.read_text() == "def f():\n    return 1\n"
