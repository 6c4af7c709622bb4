"""An exported patch's commit, put onto the upstream ref: alone, or stacked.

`apply_one` applies one patch with `git am -3` and rewrites its message for
upstream (`upstream_message`: the fork's trailers out, the exporter's
sign-off in, the patch's author kept as co-author). A patch that does not
apply alone is stacked: on the skipped backports it needs
(`stack_on_backports`, with --stack), or on the earlier exported patches
(`stack_on_exported`, trying each one's commit, then their whole chain
rebuilt by `cherry_pick_chain`). `Exported` is one patch's export, whose
commit later patches may be stacked on. Separate from export.py (the CLI
and the loop over the series): this is how one commit comes to be, in the
scratch worktree, with no branch made and nothing checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lib.proc import git, git_ok, run
from lib.series import FORK_TRAILERS, TRAILER_RE, Patch


@dataclass
class Exported:
    patch: Patch
    branch: str = ""
    files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    note: str = ""
    commit: str = ""
    # The earlier exported patches this one's commit sits on (series order):
    # its PR depends on theirs.
    stacked_on: list[Exported] = field(default_factory=list)

    def pr_name(self) -> str:
        """How a dependent PR names this one before it has a number."""
        name = self.files[0].name if self.files else self.patch.name
        return f"`{name}` (branch `{self.branch}`)"


def upstream_message(
    message: str, signer: str, tree: Path, author: str | None = None
) -> str:
    """The commit message for upstream: fork trailers out, sign-off in, and
    the patch's author credited as co-author when someone else exports it."""
    paragraphs = message.rstrip().split("\n\n")
    last = [
        line
        for line in paragraphs[-1].splitlines()
        if not ((m := TRAILER_RE.match(line.strip())) and m.group(1) in FORK_TRAILERS)
    ]
    paragraphs[-1] = "\n".join(last)
    text = "\n\n".join(p for p in paragraphs if p.strip()) + "\n"
    trailers = [f"Signed-off-by: {signer}"]
    if author and author != signer:
        trailers.insert(0, f"Co-authored-by: {author}")
    args = [a for t in trailers for a in ("--trailer", t)]
    return git(
        tree,
        "interpret-trailers",
        "--where",
        "end",
        "--if-exists",
        "addIfDifferent",
        *args,
        input=text,
    )


def apply_one(worktree: Path, patch: Patch, signer: str) -> str | None:
    """Apply `patch` at the worktree's HEAD and sign it off; None if it
    fails. The HEAD it started from when the change is already there."""
    before = git(worktree, "rev-parse", "HEAD")
    am = run(
        ["git", "-C", worktree, "am", "-q", "-3", "--keep-non-patch", patch.path],
        check=False,
    )
    if am.returncode != 0:
        run(["git", "-C", worktree, "am", "--abort"], check=False)
        return None
    if git(worktree, "rev-parse", "HEAD") == before:
        return before
    author = git(worktree, "log", "-1", "--format=%an <%ae>")
    message = upstream_message(
        git(worktree, "log", "-1", "--format=%B"), signer, worktree, author
    )
    # The signer as author, whatever GIT_AUTHOR_* the caller has set.
    name, email = signer[:-1].split(" <", 1)
    run(
        [
            "git",
            "-C",
            worktree,
            "commit",
            "-q",
            "--amend",
            "--no-verify",
            "--reset-author",
            "-F",
            "-",
        ],
        env={"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email},
        input=message,
    )
    return git(worktree, "rev-parse", "HEAD")


def stack_on_backports(
    worktree: Path, patch: Patch, backports: list[Patch], signer: str
) -> tuple[str, str | None]:
    """Apply the skipped `backports`, then `patch`, at the worktree's HEAD:
    for a patch whose context is a backport's code, on a ref older than
    the upstream fix. The HEAD the patch went on, and its commit (None,
    with the worktree back where it was, if it still does not apply)."""
    before = git(worktree, "rev-parse", "HEAD")
    for backport in backports:
        if apply_one(worktree, backport, signer) in (None, before):
            git(worktree, "reset", "-q", "--hard", before)
            return before, None
    start = git(worktree, "rev-parse", "HEAD")
    commit = apply_one(worktree, patch, signer)
    if commit is None:
        git(worktree, "reset", "-q", "--hard", before)
        return before, None
    return start, commit


def cherry_pick_chain(worktree: Path, onto: str, commits: list[str]) -> str | None:
    """`commits` picked in order onto `onto` (fast-forwarding where a commit
    already sits on HEAD, so an existing chain is reused as it is); the tip,
    or None if one does not apply."""
    git(worktree, "checkout", "-q", "--detach", onto)
    for commit in commits:
        if git_ok(worktree, "merge-base", "--is-ancestor", commit, "HEAD"):
            continue
        pick = run(["git", "-C", worktree, "cherry-pick", "--ff", commit], check=False)
        if pick.returncode != 0:
            run(["git", "-C", worktree, "cherry-pick", "--abort"], check=False)
            return None
    return git(worktree, "rev-parse", "HEAD")


def stack_on_exported(
    worktree: Path, onto: str, patch: Patch, earlier: list[Exported], signer: str
) -> tuple[str, str | None, list[Exported]]:
    """Apply `patch`, which does not apply alone on `onto`, on the earlier
    exported patches it needs: on each one's commit, newest first (with
    what that one is stacked on itself), then on all of them in series
    order. The first that applies wins: the commit it went on, its commit
    and the exported patches under it, in series order (None and [] if it
    applies on none)."""
    candidates: list[tuple[str | None, list[Exported]]] = [
        (r.commit, [*r.stacked_on, r]) for r in reversed(earlier)
    ]
    candidates.append((None, list(earlier)))
    tried: list[set[str]] = []
    for head, under in candidates:
        names = {u.patch.name for u in under}
        if not under or names in tried:
            continue
        tried.append(names)
        if head is None:
            head = cherry_pick_chain(worktree, onto, [u.commit for u in under])
            if head is None:
                continue
        else:
            git(worktree, "checkout", "-q", "--detach", head)
        commit = apply_one(worktree, patch, signer)
        if commit not in (None, head):
            return head, commit, under
    git(worktree, "checkout", "-q", "--detach", onto)
    return onto, None, []
