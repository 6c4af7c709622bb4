"""Operator mutants of the series' own lines, made and run by Cosmic Ray.

`make mutate`'s second kind of mutant (the first, in mutate.py, reverts
whole hunks): a condition negated or loosened, a boundary moved by one, a
loop that never runs, a constant changed. Cosmic Ray (a maintained mutation
tester, installed into its own venv under .work/venvs) makes them:
`cosmic-ray init` lists every mutation of the files the series changes,
`cr-filter-git` keeps those on lines the series added or changed (the diff
against the upstream base), `cr-filter-operators` drops the operators in
EXCLUDED_OPERATORS, and `cosmic-ray exec` runs the fast suite against each
mutant on one HTTP worker per git worktree (its http distributor), so two
run at once; a mutant the suite does not kill then faces the differential
oracle (DIFFERENTIAL_SEEDS traces against the base). Each mutant is then
attributed to the patch that wrote its line (`git blame`).

A mutant that cannot change behaviour is listed in
scripts/data/equivalent_operators.toml (patch, the mutated line, operator)
with the reason, and not counted.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from lib.errors import ForkError
from lib.paths import ROOT, WORK, rel
from lib.proc import free_port, git, run
from lib.testenv import tree_env

COSMIC_RAY = "cosmic-ray==8.7.0"
VENV = WORK / "venvs" / "cosmic-ray"
# Operators whose mutants say little: an arithmetic operator swapped for an
# unrelated one (a shift, a power, a bit operation) only makes nonsense
# numbers, and a comparison swapped for a far one (== for >) is covered by
# the negation and boundary mutants kept (== for !=, > for >=, is for is
# not). What stays: negated and loosened conditions, boundaries moved by
# one, + for - and back, booleans flipped, and/or swapped, a loop that never
# runs, break for continue and back, a constant changed, an exception
# replaced, a decorator removed.
EXCLUDED_OPERATORS = [
    r"core/ReplaceBinaryOperator_(?!Add_Sub$|Sub_Add$)",
    r"core/ReplaceComparisonOperator_"
    r"(?!Eq_NotEq$|NotEq_Eq$|Gt_GtE$|GtE_Gt$|Lt_LtE$|LtE_Lt$|Is_IsNot$|IsNot_Is$"
    r"|In_NotIn$|NotIn_In$)",
    r"core/ReplaceUnaryOperator_(?!Delete_Not$)",
]
# Traces of the differential oracle a mutant the tests did not kill must
# pass: a mutant that changes what the base does where no patch says so is
# killed by it (the oracle's whole point: "changes nothing else").
DIFFERENTIAL_SEEDS = 40


def is_mutation_subject(path: str) -> bool:
    """Whether the series' change to `path` is mutated: vLLM's own code only.
    The tests the patches carry into vLLM's tree (tests/v1/...) are the
    proof, not the subject: no test of the suite runs them, so every mutant
    of theirs would survive (that doubled 0.33.0's mutants and sank it to
    28% once 0002 carried one). The overlay's vllm/_fork.py is not a patch.
    """
    return path.startswith("vllm/") and path.endswith(".py") and path != "vllm/_fork.py"


def differential_command(series_dir: Path, tree: str, out: str) -> list[str]:
    """The differential oracle of `series_dir`'s base against `tree`."""
    return [
        sys.executable,
        str(ROOT / "scripts" / "prove" / "differential.py"),
        "--series",
        str(series_dir),
        "--series-tree",
        tree,
        "--seeds",
        str(DIFFERENTIAL_SEEDS),
        "--out",
        out,
        "--cache-base",
    ]


# The mutants and hunks that cannot change behaviour, with the reason: data,
# not code (one [[claim]] table per mutant or hunk).
DATA = ROOT / "scripts" / "data"


def load_claims(path: Path, fields: tuple[str, ...]) -> dict[tuple[str, ...], str]:
    """The claims of `path`, `fields` -> why, in the file's order: the first
    claim that matches a mutant explains it."""
    claims: dict[tuple[str, ...], str] = {}
    for n, claim in enumerate(tomllib.loads(path.read_text())["claim"], 1):
        if sorted(claim) != sorted((*fields, "why")):
            raise ForkError(
                f"{rel(path)}: claim {n} has {', '.join(claim)}, "
                f"not {', '.join(fields)}, why"
            )
        key = tuple(claim[f] for f in fields)
        if key in claims:
            raise ForkError(f"{rel(path)}: claim {n} repeats an earlier one")
        claims[key] = claim["why"]
    return claims


# (patch subject fragment, the mutated line stripped, operator) -> why the
# mutant cannot change behaviour.
EQUIVALENT = load_claims(
    DATA / "equivalent_operators.toml", ("patch", "line", "operator")
)


@dataclass
class OperatorMutant:
    patch: str
    file: str
    line: int
    operator: str
    state: str  # killed, survived, equivalent, incompetent
    diff: str
    detail: str = ""

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line} {self.operator.removeprefix('core/')}"


def cosmic_ray_venv() -> Path:
    """The venv holding Cosmic Ray (apart from the vLLM venvs: its
    dependencies must not move theirs)."""
    bin_dir = VENV / "bin"
    if not (bin_dir / "cosmic-ray").exists():
        print(f"==> installing {COSMIC_RAY} into {VENV}", file=sys.stderr)
        run([sys.executable, "-m", "venv", str(VENV)])
        run([str(bin_dir / "pip"), "install", "-q", COSMIC_RAY])
    return bin_dir


def write_config(
    path: Path,
    files: list[str],
    base_tag: str,
    command: str,
    timeout: float,
    workers: list[str],
) -> None:
    # JSON strings are TOML basic strings (the test command holds quotes).
    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    path.write_text(
        "[cosmic-ray]\n"
        f"module-path = {toml_list(files)}\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n\n"
        "[cosmic-ray.distributor]\n"
        'name = "http"\n\n'
        "[cosmic-ray.distributor.http]\n"
        f"worker-urls = {toml_list(workers)}\n\n"
        "[cosmic-ray.filters.git-filter]\n"
        f"branch = {json.dumps(base_tag)}\n\n"
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = {toml_list(EXCLUDED_OPERATORS)}\n"
    )


def blame(tree: Path, base_tag: str, file: str) -> dict[int, str]:
    """Line number -> subject of the series commit that wrote it (lines of
    the base are left out)."""
    out = git(tree, "blame", "--line-porcelain", f"{base_tag}..HEAD", "--", file)
    subjects: dict[str, str] = {}
    lines: dict[int, str] = {}
    commit, line = "", 0
    for row in out.splitlines():
        head = re.match(r"^([0-9a-f]{40}) \d+ (\d+)", row)
        if head:
            commit, line = head[1], int(head[2])
        elif row.startswith("summary "):
            subjects.setdefault(commit, row[len("summary ") :])
        elif row.startswith("boundary"):
            commit = ""
        elif row.startswith("\t") and commit:
            lines[line] = subjects[commit]
    return lines


def run_operator_mutants(
    tree: Path,
    base_tag: str,
    worktrees: list[Path],
    python: Path,
    tests: list[str],
    series_dir: Path,
    work: Path,
    rerun_survivors: bool = False,
    only: list[str] | None = None,
) -> list[OperatorMutant]:
    """Run the operator mutants of the series in `tree`; with
    `rerun_survivors`, only those that survived the last run of the same
    series (the session is kept for this), the others keeping their result:
    new tests can only kill more. With `only` (subject fragments), only the
    mutants of lines the matching patches wrote run."""
    bin_dir = cosmic_ray_venv()
    files = [
        f
        for f in git(tree, "diff", "--name-only", base_tag, "HEAD").split()
        if is_mutation_subject(f)
    ]
    pytest = [
        str(python),
        "-m pytest -x -q -p no:cacheprovider -p fork_upstream_plugin",
        f"-c {ROOT / 'pyproject.toml'} --rootdir {ROOT}",
        *(str(ROOT / t) for t in tests),
    ]
    # Run in the worker's worktree; the oracle only for what the tests pass.
    oracle = differential_command(series_dir, ".", ".differential")
    command = "sh -c " + shlex.quote(f"{' '.join(pytest)} && {shlex.join(oracle)}")
    config, session = work / "cosmic-ray.toml", work / "session.sqlite"
    stamp = work / "session.head"
    head = git(tree, "rev-parse", "HEAD").strip()
    # A mutant that hangs is killed at the timeout: far above the suite's
    # own time, which the harness's step limits keep bounded.
    ports = [free_port() for _ in worktrees]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    write_config(config, files, base_tag, command, 600.0, urls)
    home = worktrees[0]
    if rerun_survivors and session.exists() and stamp.read_text() == head:
        with sqlite3.connect(session) as db:
            db.execute("delete from work_results where test_outcome = 'SURVIVED'")
    else:
        if rerun_survivors:
            print("    no run of this series to resume: all mutants", file=sys.stderr)
        session.unlink(missing_ok=True)
        run([bin_dir / "cosmic-ray", "init", config, session], cwd=home)
        # (The two filters take their arguments in different forms.)
        run([bin_dir / "cr-filter-git", "--config", config, session], cwd=home)
        run([bin_dir / "cr-filter-operators", session, config], cwd=home)
        stamp.write_text(head)
    if only:
        skip_other_patches(session, tree, base_tag, only)
    workers = [
        subprocess.Popen(
            [str(bin_dir / "cosmic-ray"), "http-worker", "--port", str(port)],
            cwd=wt,
            env={**os.environ, **tree_env(wt)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for wt, port in zip(worktrees, ports, strict=True)
    ]
    try:
        wait_for_ports(ports)
        total = pending(session)
        print(f"    {total} operator mutants on the series' lines", file=sys.stderr)
        proc = subprocess.Popen(
            [str(bin_dir / "cosmic-ray"), "exec", str(config), str(session)],
            cwd=home,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        while proc.poll() is None:
            time.sleep(15)
            left = pending(session)
            print(f"    [{total - left}/{total}] operator mutants run", file=sys.stderr)
        if proc.returncode != 0:
            raise ForkError(f"cosmic-ray exec failed:\n{proc.stderr.read()[-2000:]}")
    finally:
        for w in workers:
            w.terminate()
            w.wait()
    return outcomes(tree, base_tag, session)


def skip_other_patches(
    session: Path, tree: Path, base_tag: str, only: list[str]
) -> None:
    """Mark the pending mutants of lines that no patch matching `only` wrote
    as skipped, as Cosmic Ray's own filters do, so that they neither run nor
    count."""
    blamed: dict[str, dict[int, str]] = {}
    skipped = []
    with sqlite3.connect(session) as db:
        rows = db.execute(
            "select job_id, module_path, start_pos_row from mutation_specs "
            "where job_id not in (select job_id from work_results)"
        ).fetchall()
        for job, file, line in rows:
            if file not in blamed:
                blamed[file] = blame(tree, base_tag, file)
            subject = blamed[file].get(line, "")
            if not any(fragment in subject for fragment in only):
                skipped.append((job,))
        db.executemany(
            "insert into work_results (job_id, worker_outcome, output) "
            "values (?, 'SKIPPED', 'line of a patch not selected (--only)')",
            skipped,
        )
    print(
        f"    --only: {len(rows) - len(skipped)} of {len(rows)} mutants kept",
        file=sys.stderr,
    )


def wait_for_ports(ports: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise ForkError(f"no cosmic-ray http-worker on port {port}")
            time.sleep(0.5)


def pending(session: Path) -> int:
    with sqlite3.connect(session) as db:
        return db.execute(
            "select count(*) from work_items where job_id not in "
            "(select job_id from work_results)"
        ).fetchone()[0]


def claim_holds_on(why: str, base_tag: str) -> bool:
    """A reason that starts with a release ("0.20.2: ...") was shown for that
    release's code only; the same line on another release is not claimed."""
    release = re.match(r"(\d+\.\d+\.\d+):", why)
    return release is None or base_tag.endswith(f"v{release[1]}")


def outcomes(tree: Path, base_tag: str, session: Path) -> list[OperatorMutant]:
    with sqlite3.connect(session) as db:
        rows = db.execute(
            "select m.module_path, m.start_pos_row, m.operator_name, "
            "r.test_outcome, r.worker_outcome, r.diff, r.output "
            "from mutation_specs m join work_results r on m.job_id = r.job_id "
            "where lower(r.worker_outcome) != 'skipped' "
            "order by m.module_path, m.start_pos_row"
        ).fetchall()
    blamed: dict[str, dict[int, str]] = {}
    out = []
    for file, line, operator, tested, worker, diff, output in rows:
        # Cosmic Ray stores its enums by name (KILLED, NORMAL).
        tested, worker = (tested or "").lower(), worker.lower()
        if file not in blamed:
            blamed[file] = blame(tree, base_tag, file)
        patch = blamed[file].get(line, "(upstream line)")
        text = (tree / file).read_text().splitlines()[line - 1].strip()
        mutant = OperatorMutant(patch, file, line, operator, "", diff or "")
        why = next(
            (
                w
                for (fragment, src, op), w in EQUIVALENT.items()
                if fragment in patch
                and src == text
                and op == operator
                and claim_holds_on(w, base_tag)
            ),
            None,
        )
        # A claim is about the mutants a line's text names: one on another
        # line with the same text that a test kills stays killed.
        if why is not None and tested != "killed":
            mutant.state, mutant.detail = "equivalent", why
        elif worker != "normal" or tested == "incompetent":
            mutant.state = "incompetent"
            mutant.detail = (output or "")[-300:]
        else:
            mutant.state = "killed" if tested == "killed" else "survived"
            if mutant.state == "killed":
                failed = re.findall(r"(?m)^FAILED (\S+)", output or "")
                mutant.detail = failed[0] if failed else "timeout or error"
        out.append(mutant)
    return out
