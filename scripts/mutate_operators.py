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

A mutant that cannot change behaviour is listed in EQUIVALENT (patch, the
mutated line, operator) with the reason, and not counted.
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
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, WORK, ForkError, free_port, git, run
from testenv import tree_env

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
        str(ROOT / "scripts" / "differential.py"),
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


# (patch subject fragment, the mutated line stripped, operator) -> why the
# mutant cannot change behaviour.
PREFILL_ENDS = (
    "a request whose chunk ends its prefill would be in the set only until "
    "_update_after_schedule at the end of the same schedule(), and it holds "
    "the blocks of its whole prompt by then, so it reserves none meanwhile"
)
TAIL_SPECIAL_CASE = (
    "linking the fake tail back as the last popped block, then None after it, "
    "is what the special case does (it is redundant: a follow-up)"
)
EXTERNAL_LATER = (
    "with the external-token blocks not taken here, allocate_slots's "
    "allocate_new_blocks takes them next: the same number from the same free "
    "queue, after every group touched its hits (0007's order holds), refused "
    "and given back the same way; only which block ids each group gets "
    "differs, and nothing depends on ids"
)
CLAMP = (
    "the clamped count is only tested for > 0 below: it is positive exactly "
    "when some computed token is not skipped, with or without the clamp (a "
    "window keeps the last token; all-skipped tokens are null padding and "
    "leave no block to allocate)"
)
EQUIVALENT: dict[tuple[str, str, str], str] = {
    (
        "Typed KV block pool errors",
        "if n == 1:",
        "core/NumberReplacer",
    ): "n == 0 returned above, so n == 0 here only turns the one-block path "
    "off: the general path pops the same block with the same checks (the "
    "short path is there for speed, make bench; n == 2 is killed)",
    (
        "Pin SimpleCPUOffload CPU hits",
        "if pin is not None and pin.num_tokens > num_external_tokens:",
        "core/ReplaceComparisonOperator_Gt_GtE",
    ): "equal counts returned the pin two lines above; > and >= differ only there",
    (
        "admit an async KV load",
        "if num_computed_tokens + num_new_tokens < request.num_tokens:",
        "core/ReplaceComparisonOperator_Lt_LtE",
    ): PREFILL_ENDS,
    (
        "admit an async KV load",
        "if num_computed_tokens + num_new_tokens < request.num_tokens:",
        "core/ReplaceBinaryOperator_Add_Sub",
    ): PREFILL_ENDS,
    (
        "admit an async KV load",
        "num_encoder_tokens=0,",
        "core/NumberReplacer",
    ): "an in-flight prefill was scheduled, so it holds every cross-attention "
    "block (taken whole at its first step) and counts as running there: any "
    "encoder count from -1 to 1 asks max(..., 0) = 0 more blocks",
    (
        "touch every group's prefix hits",
        "if num_skipped_tokens // self.block_size > 0:",
        "core/ReplaceComparisonOperator_Gt_GtE",
    ): CLAMP,
    (
        "touch every group's prefix hits",
        "num_total_computed_tokens - num_skipped_tokens,",
        "core/ReplaceBinaryOperator_Sub_Add",
    ): CLAMP,
    **{
        ("touch every group's prefix hits", src, op): why
        for src, op, why in [
            ("if num_skipped_tokens // self.block_size > 0:", "core/AddNot", CLAMP),
            (
                "if num_skipped_tokens // self.block_size > 0:",
                "core/NumberReplacer",
                CLAMP,
            ),
            ("if num_external_computed_tokens > 0:", "core/AddNot", EXTERNAL_LATER),
            (
                "if num_external_computed_tokens > 0:",
                "core/NumberReplacer",
                "> -1 runs the step for 0 external tokens, which takes no block; "
                "> 1 leaves a single external token's block to allocate_slots: "
                + EXTERNAL_LATER,
            ),
            (
                "if num_external_computed_tokens > 0:",
                "core/ReplaceComparisonOperator_Gt_GtE",
                "with 0 external tokens every group's step takes no block",
            ),
            (
                "for group, (manager, fresh) in enumerate(",
                "core/ZeroIterationForLoop",
                EXTERNAL_LATER,
            ),
            (
                "group = 0",
                "core/NumberReplacer",
                "enumerate() sets group before anything in the loop can raise; "
                "the first value is never read",
            ),
        ]
    },
    (
        "allocate_slots: give back everything",
        "or num_external_computed_tokens > 0",
        "core/ReplaceComparisonOperator_Gt_GtE",
    ): "upstream's condition, which 0002 only indents into its try: with >= "
    "every call registers the request, and a request it registers only now "
    "(no hit, no external token) gets no block and num_cached_block 0, the "
    "default cache_blocks reads; a refusal frees that registration again",
    (
        "allocate_slots: give back everything",
        "or num_external_computed_tokens > 0",
        "core/NumberReplacer",
    ): "0.20.2: > -1 is >= 0, see the ReplaceComparisonOperator claim; > 1 "
    "leaves a single external token's block to allocate_new_blocks, which "
    "takes it next (on 0.33.0 a test kills both: that block gets zeroed)",
    (
        "allocate_slots: give back everything",
        "num_blocks=-1 if req_blocks is None else len(req_blocks),",
        "core/NumberReplacer",
    ): "0.33.0: any negative count marks a request that had no entry; the undo "
    "reads it only as < 0 and as max(num_blocks, 0)",
    (
        "allocate_slots: give back everything",
        "if mark.num_blocks < 0 and not self.req_to_blocks.get(request_id):",
        "core/NumberReplacer",
    ): "0.33.0: < 1 also drops the entry of a request that held no block, "
    "< -1 drops none: either way only an empty list, and req_to_blocks is a "
    "defaultdict (an empty entry and none read the same)",
    (
        "allocate_slots: give back everything",
        "if mark.num_blocks < 0 and not self.req_to_blocks.get(request_id):",
        "core/ReplaceAndWithOr",
    ): "0.33.0: a request with no entry before has its list cut back to empty "
    "just above, so only an empty list is ever dropped, and req_to_blocks is "
    "a defaultdict: an empty entry and none read the same",
    (
        "allocate_slots: give back everything",
        "i = 0",
        "core/NumberReplacer",
    ): "0.33.0: enumerate() sets i before anything in the loop can raise; the "
    "first value is never read",
    (
        "store only blocks that still",
        "if block_idx >= len(resolved_hashes):",
        "core/ReplaceComparisonOperator_GtE_Gt",
    ): "0.33.0: the scan asks only for confirmed full blocks, and the request "
    "holds a hash for each of them, so block_idx < len(resolved_hashes)",
    (
        "store only blocks that still",
        "return False",
        "core/ReplaceFalseWithTrue",
    ): "0.33.0: the guard's return for a block past the request's hashes, "
    "which the scan never asks about (see the GtE_Gt claim)",
    (
        "allocate_slots: give back everything",
        "tail_start = max(0, prev_block_len - self.num_speculative_blocks)",
        "core/NumberReplacer",
    ): "align mode moves the speculative tail only of a request it allocated "
    "before, which holds at least 1 + num_speculative_blocks blocks, so the "
    "difference is at least 1 there and max(0, .) = max(1, .); a request not "
    "allocated before has nothing below prev_block_len moved, so restoring "
    "one position fewer changes nothing",
    (
        "allocate_slots: give back everything",
        "if not req_blocks and request_id not in self.num_cached_block:",
        "core/ReplaceAndWithOr",
    ): "the undo runs for registered requests (in num_cached_block), so the "
    "two differ only for an empty list, and req_to_blocks is a defaultdict "
    "that every reader indexes, .get()s or .pop()s with a default: an empty "
    "entry and none read the same",
    (
        "Store the final blocks of a request",
        "if block_ids and not store_state.finished:",
        "core/ReplaceAndWithOr",
    ): "the scheduler finishes a request once, so its store state is not "
    "finished yet here; with no block ids the flush scans nothing and "
    "queues nothing",
    (
        "Store the final blocks of a request",
        "break",
        "core/ReplaceBreakWithContinue",
    ): "the flush's stop at an unhashed block: "
    "cache_blocks hashes a group's blocks in order, so the hashed ones are "
    "a prefix of the request's blocks (nulls aside, which are skipped "
    "before): after an unhashed block every later one is unhashed too, and "
    "continuing past it adds nothing",
    (
        "Store the final blocks of a request",
        "return bool(self._store_event_to_blocks or self._finish_flushes)",
        "core/ReplaceOrWithAnd",
    ): "0.20.2: nothing calls the connector's has_pending_stores",
    (
        "Store the final blocks of a request",
        "return self._finish_request(request, (block_ids,) if block_ids else ())",
        "core/AddNot",
    ): "the scheduler calls request_finished_all_groups, not request_finished, "
    "for a connector that supports HMA, as SimpleCPUOffloadConnector does",
    (
        "Typed KV block pool errors",
        "if popped and popped[-1] is self.fake_free_list_tail:",
        "core/AddNot",
    ): TAIL_SPECIAL_CASE,
    (
        "Typed KV block pool errors",
        "if popped and popped[-1] is self.fake_free_list_tail:",
        "core/NumberReplacer",
    ): TAIL_SPECIAL_CASE,
}


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
